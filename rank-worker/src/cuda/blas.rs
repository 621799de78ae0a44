//! Dense prefill products through cuBLAS: the attention projections, the router and lm_head of
//! steps with many tokens. Our own int8 / bf16 GEMMs (matmul.rs) reach ~130 TOPS on these
//! shapes because they dequantize inside an `mma.sync` loop; cuBLAS runs the Hopper/Blackwell
//! tensor-core pipelines (wgmma, TMA) at several times that. So the weights are dequantized
//! once per call into a bf16 scratch (`dqb_*`, exact values rounded to nearest even), X is
//! rounded to bf16 (`x_bf16`), and `cublasGemmEx` multiplies with f32 accumulation. F32 weights
//! (the router, f32 checkpoints) take `cublasSgemm` on the weights as stored: exact f32, no
//! TF32. Expert products keep the grouped kernels (their sizes live on the device).
//!
//! On by default (`MINIMAX_BLAS=0` turns it off) for steps of at least [`blas_min_tokens`]
//! tokens; under `MINIMAX_GEMM=bf16x3` (what the fixture comparisons pin) only F32 weights take
//! it, since one bf16 pass is less exact than three. A missing libcublas logs one warning and
//! leaves every product on the built-in kernels.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::cublas::result as cr;
use cudarc::cublas::sys as cs;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice};
use minimax_shared::quant::GgmlType;

use super::env_flag::EnvFlag;
use super::error::CudaError;
use super::gpu::{Arg, DevMat, Gpu};
use super::matmul::{GemmPrecision, gemm_precision};

/// cuBLAS for dense prefill products, on unless `MINIMAX_BLAS=0`.
static BLAS: EnvFlag = EnvFlag::new("MINIMAX_BLAS", true);

static BLAS_WARM_WIDE: EnvFlag = EnvFlag::new("MINIMAX_BLAS_WARM_WIDE", true);

/// Whether model load warms cuBLAS at 252 token counts up to 4,096 instead of 512 and 2,048
/// (the default; `MINIMAX_BLAS_WARM_WIDE=0` = the two; `CudaModel::warm_blas` says why):
/// the load's cuBLAS warm-up 236 → 802 ms on an H200, about half of a new prompt length's
/// first-call cost gone.
pub fn blas_warm_wide() -> bool {
    BLAS_WARM_WIDE.get()
}

/// Whether dense products of many tokens go through cuBLAS ([`BLAS`] or what [`set_blas`] set).
pub fn blas_on() -> bool {
    BLAS.get()
}

/// Turns the cuBLAS path on or off for every later product (`None`: back to `MINIMAX_BLAS`);
/// benchmark A/B and tests of the built-in kernels.
pub fn set_blas(on: Option<bool>) {
    BLAS.set(on);
}

/// Not read yet: take `MINIMAX_BLAS_MIN_TOKENS` on first use.
const UNREAD: usize = usize::MAX;
/// Default of [`blas_min_tokens`]: up to 64 tokens the built-in int8 GEMM (one 64-token tile) is
/// as fast as dequantization + cuBLAS, from 96 cuBLAS is 1.3-4.6x faster (M2.7's q and o
/// products on one H200, docs/CUDA.md "Dense prefill products through cuBLAS").
const DEFAULT_MIN_TOKENS: usize = 65;
static MIN_TOKENS: AtomicUsize = AtomicUsize::new(UNREAD);

/// Fewest tokens of a product that takes cuBLAS (`MINIMAX_BLAS_MIN_TOKENS`, default 65; the
/// GEMMs only ever see more than [`super::GEMM_MIN_TOKENS`]).
pub fn blas_min_tokens() -> usize {
    match MIN_TOKENS.load(Ordering::Relaxed) {
        UNREAD => {
            let v = std::env::var("MINIMAX_BLAS_MIN_TOKENS").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_MIN_TOKENS);
            MIN_TOKENS.store(v, Ordering::Relaxed);
            v
        }
        v => v,
    }
}

/// Sets [`blas_min_tokens`] (`None`: back to the environment's value); benchmarks and tests.
pub fn set_blas_min_tokens(n: Option<usize>) {
    MIN_TOKENS.store(n.unwrap_or(UNREAD), Ordering::Relaxed);
}

/// Largest dequantized weight slice in elements (64 MiB of bf16): bigger matrices (lm_head,
/// 200,064 x 3,072) are multiplied in row slices so the scratch stays small.
const DEFAULT_SLICE_ELEMS: usize = 32 << 20;
static SLICE_ELEMS: AtomicUsize = AtomicUsize::new(DEFAULT_SLICE_ELEMS);

/// Sets the row-slice size in elements (`None`: the default); tests make it small to cover the
/// slicing.
pub fn set_blas_slice_elems(n: Option<usize>) {
    SLICE_ELEMS.store(n.filter(|&n| n > 0).unwrap_or(DEFAULT_SLICE_ELEMS), Ordering::Relaxed);
}

/// cuBLAS's workspace: fixed, so no call allocates (and a graph capture could include one).
const WORKSPACE_BYTES: usize = 32 << 20;

/// One GPU's cuBLAS handle (bound to the [`Gpu`]'s stream), its workspace and the bf16 scratch
/// of the dequantized weights and converted inputs (grown on demand, reused in stream order).
pub struct Blas {
    handle: cs::cublasHandle_t,
    /// Bound before the handle is destroyed (a drop may run on a thread without it current).
    ctx: Arc<CudaContext>,
    workspace: CudaSlice<u8>,
    wbuf: Mutex<Option<CudaSlice<u16>>>,
    xbuf: Mutex<Option<CudaSlice<u16>>>,
}

// The handle and the scratch are used by one thread at a time: a rank drives each GPU from one
// thread, one step after another (the mutexes only guard the scratch buffers' growth; two
// threads running products on one Gpu at once would share the scratch contents).
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        unsafe {
            let _ = cr::destroy_handle(self.handle);
        }
    }
}

fn blas_err(call: &'static str) -> impl Fn(cr::CublasError) -> CudaError {
    move |e| CudaError::Blas { call, detail: format!("{:?}", e.0) }
}

impl Blas {
    /// A handle on `g`'s stream with a fixed workspace and the default (non-TF32) math mode.
    pub fn new(g: &Gpu) -> Result<Self, CudaError> {
        if !unsafe { cs::is_culib_present() } {
            return Err(CudaError::LibraryMissing { lib: "libcublas", hint: "put the CUDA toolkit's lib64 (libcublas, libcublasLt) on LD_LIBRARY_PATH, or set MINIMAX_BLAS=0" });
        }
        g.ctx.bind_to_thread()?;
        // Everything fallible before the handle exists, so a failure leaks nothing (Drop
        // destroys the handle once `Self` holds it).
        let workspace = g.stream.alloc_zeros::<u8>(WORKSPACE_BYTES)?;
        let handle = cr::create_handle().map_err(blas_err("cublasCreate"))?;
        let blas = Self { handle, ctx: g.ctx.clone(), workspace, wbuf: Mutex::new(None), xbuf: Mutex::new(None) };
        unsafe {
            cr::set_stream(handle, g.stream.cu_stream() as _).map_err(blas_err("cublasSetStream"))?;
            let ws = g.ptr(&blas.workspace);
            cs::cublasSetWorkspace_v2(handle, ws as *mut _, WORKSPACE_BYTES).result().map_err(blas_err("cublasSetWorkspace"))?;
            cs::cublasSetMathMode(handle, cs::cublasMath_t::CUBLAS_DEFAULT_MATH).result().map_err(blas_err("cublasSetMathMode"))?;
        }
        Ok(blas)
    }
}

/// A scratch buffer of at least `n` elements: the one in `slot` if large enough, else a new
/// one (the old one is freed in stream order, after the work queued on it).
fn scratch(g: &Gpu, slot: &Mutex<Option<CudaSlice<u16>>>, n: usize) -> Result<u64, CudaError> {
    let mut s = slot.lock().unwrap();
    if s.as_ref().is_none_or(|b| b.len() < n) {
        *s = None;
        // Every element a product reads is written by the conversion before it.
        *s = Some(unsafe { g.stream.alloc::<u16>(n.next_multiple_of(1 << 20))? });
    }
    Ok(g.ptr(s.as_ref().unwrap()))
}

impl Gpu {
    /// This GPU's cuBLAS, created on first use; `None` (after one warning) when it cannot be.
    pub fn blas(&self) -> Option<&Blas> {
        self.blas
            .get_or_init(|| match Blas::new(self) {
                Ok(b) => Some(b),
                Err(e) => {
                    tracing::warn!(error = %e, "cuBLAS unavailable: dense prefill products use the built-in GEMMs");
                    None
                }
            })
            .as_ref()
    }

    /// Whether [`Gpu::matmul`] hands `w` times `n` tokens to cuBLAS: the switch is on, enough
    /// tokens (and few enough for one launch), a dense matrix of a type whose bf16 rounding the
    /// precision setting allows, and cuBLAS could be loaded. F32 weights always (SGEMM is exact
    /// f32); under `int8` (the default) IQ4_XS and Q8_0, the types it already multiplies with q8
    /// activations (its accuracy check at M2.7 size covers them; other types keep their 3-pass
    /// kernels there); under one-pass `bf16` every type but F16 (bf16 would drop 3 of its bits);
    /// under `bf16x3` nothing else.
    pub fn blas_takes(&self, w: &DevMat, n: usize) -> bool {
        if !blas_on() || n < blas_min_tokens() || n > 65535 || w.n_experts > 0 || !w.ty.is_supported() || w.rows == 0 || w.cols == 0 {
            return false;
        }
        let prec = gemm_precision();
        let allowed = match w.ty {
            GgmlType::F32 => true,
            GgmlType::F16 => false,
            GgmlType::IQ4_XS | GgmlType::Q8_0 => prec != GemmPrecision::Bf16x3,
            _ => prec == GemmPrecision::Bf16,
        };
        // The loads' alignment: F32 rows 4 bytes, BF16 and Q8_0 (2-byte loads) 2; the others
        // dequantize byte by byte in whole 32-element chunks.
        let align = match w.ty {
            GgmlType::F32 => 4u64,
            GgmlType::BF16 | GgmlType::Q8_0 => 2,
            _ => 1,
        };
        let fits = w.ptr % align == 0 && w.row_bytes as u64 % align == 0 && (w.ty.block_elems() == 1 || w.cols % 32 == 0);
        allowed && fits && self.blas().is_some()
    }

    /// `Y[n × rows] = X[n × cols] · Wᵀ` (or `+=` with `accumulate`) through cuBLAS; X and Y f32
    /// rows `xs` / `ys` apart. Callers check [`Gpu::blas_takes`] first.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_blas(&self, w: &DevMat, x: u64, xs: usize, y: u64, ys: usize, n: usize, accumulate: bool) -> Result<(), CudaError> {
        if n == 0 || w.rows == 0 {
            return Ok(());
        }
        let b = self.blas().ok_or_else(|| CudaError::Shape("matmul_blas: cuBLAS is not available".into()))?;
        blas_shape(w, xs, ys, n)?;
        self.ctx.bind_to_thread()?;
        if w.ty == GgmlType::F32 {
            return self.blas_sgemm(b, w, x, xs, y, ys, n, accumulate);
        }
        let xb = self.blas_x(b, x, xs, n, w.cols)?;
        self.blas_bf16(b, w, xb, y, ys, n, accumulate)
    }

    /// Whether [`Gpu::matvec_shared`] runs these weights times `n` rows of `x` through cuBLAS
    /// with one conversion of X.
    pub fn shared_blas_takes(&self, ws: &[&DevMat], x: u64, xs: usize, n: usize) -> bool {
        let cols = ws.first().map(|w| w.cols).unwrap_or(0);
        n > super::GEMM_MIN_TOKENS && ws.iter().all(|w| w.cols == cols && w.ty != GgmlType::F32 && self.gemm_unfit(w, x, xs).is_none() && self.blas_takes(w, n))
    }

    /// Whether a dense product of `w` times `n` rows of `x` runs through cuBLAS (what
    /// [`Gpu::matvec`] then [`Gpu::matmul`] decide).
    pub fn dense_blas_takes(&self, w: &DevMat, x: u64, xs: usize, n: usize) -> bool {
        n > super::GEMM_MIN_TOKENS && self.gemm_unfit(w, x, xs).is_none() && self.blas_takes(w, n)
    }

    /// Several products of one input (q, k and v of a layer): `Y_i = X · W_iᵀ` for each
    /// (W_i, Y_i, its stride). Through cuBLAS (when it takes every one) X is converted once;
    /// otherwise each goes through [`Gpu::matvec`].
    pub fn matvec_shared(&self, prods: &[(&DevMat, u64, usize)], x: u64, xs: usize, n: usize) -> Result<(), CudaError> {
        let ws: Vec<&DevMat> = prods.iter().map(|p| p.0).collect();
        if !self.shared_blas_takes(&ws, x, xs, n) {
            for &(w, y, ys) in prods {
                self.matvec(w, x, xs, y, ys, n, false)?;
            }
            return Ok(());
        }
        self.blas_shared(prods, x, xs, n)
    }

    /// [`Gpu::matvec_shared`]'s cuBLAS branch without its checks: callers decided with
    /// [`Gpu::shared_blas_takes`] (on the quantized weights, when these are their bf16 copies).
    pub fn blas_shared(&self, prods: &[(&DevMat, u64, usize)], x: u64, xs: usize, n: usize) -> Result<(), CudaError> {
        let cols = prods.first().map(|p| p.0.cols).unwrap_or(0);
        let b = self.blas().ok_or_else(|| CudaError::Shape("matvec_shared: cuBLAS is not available".into()))?;
        for &(w, _, ys) in prods {
            blas_shape(w, xs, ys, n)?;
        }
        self.ctx.bind_to_thread()?;
        let xb = self.blas_x(b, x, xs, n, cols)?;
        for &(w, y, ys) in prods {
            self.blas_bf16(b, w, xb, y, ys, n, false)?;
        }
        Ok(())
    }

    /// Dequantizes `w` (not F32 / BF16) to packed bf16 rows at `out` (`rows × cols` elements),
    /// as the per-call conversion of [`Gpu::matmul_blas`] does: its persistent copy.
    pub fn dequant_bf16(&self, w: &DevMat, out: u64) -> Result<(), CudaError> {
        if matches!(w.ty, GgmlType::F32 | GgmlType::BF16) || w.n_experts > 0 || (w.ty.block_elems() > 1 && w.cols % 32 != 0) {
            return Err(CudaError::Shape(format!("dequant_bf16: {} {} x {}", w.ty.name(), w.rows, w.cols)));
        }
        // Row slices of at most i32::MAX - 256 threads (one launch each).
        let per_row = if w.ty.block_elems() == 1 { w.cols } else { w.cols / 32 };
        let slice = ((i32::MAX as usize - 256) / per_row).clamp(1, w.rows.max(1));
        for r0 in (0..w.rows).step_by(slice) {
            self.dqb_rows(w, r0, slice.min(w.rows - r0), out + (r0 * w.cols * 2) as u64)?;
        }
        Ok(())
    }

    /// F32 weights as stored: row-major W (rows x cols, lda = its row length) is column-major
    /// Wᵀ, so C (column-major Yᵀ) = op_T(W) · X.
    #[allow(clippy::too_many_arguments)]
    fn blas_sgemm(&self, b: &Blas, w: &DevMat, x: u64, xs: usize, y: u64, ys: usize, n: usize, accumulate: bool) -> Result<(), CudaError> {
        let (one, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
        let lda = (w.row_bytes / 4) as i32;
        use cs::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        self.timed("blas_sgemm", || unsafe {
            cr::sgemm(b.handle, CUBLAS_OP_T, CUBLAS_OP_N, w.rows as i32, n as i32, w.cols as i32, &one, w.ptr as *const f32, lda, x as *const f32, xs as i32, &beta, y as *mut f32, ys as i32)
                .map_err(blas_err("cublasSgemm"))
        })
    }

    /// X (`n` f32 rows of `cols`, `xs` apart) as packed bf16 in the input scratch; its address.
    fn blas_x(&self, b: &Blas, x: u64, xs: usize, n: usize, cols: usize) -> Result<u64, CudaError> {
        if x % 16 != 0 || xs % 4 != 0 || cols % 4 != 0 || n > 65535 {
            return Err(CudaError::Shape(format!("matmul_blas: input {x:#x} stride {xs} cols {cols} not float4-aligned, or {n} rows")));
        }
        let xb = scratch(self, &b.xbuf, n * cols)?;
        self.launch("x_bf16", (cols.div_ceil(1024) as u32, n as u32, 1), 256, 0, &[Arg::P(x), Arg::L(xs as i64), Arg::I(n as i32), Arg::I(cols as i32), Arg::P(xb)])?;
        Ok(xb)
    }

    /// `Y (+)= Xb · Wᵀ` with Xb the converted input: W dequantized to bf16 in row slices (BF16
    /// weights used as stored), each multiplied by cublasGemmEx (f32 accumulation, f32 out).
    #[allow(clippy::too_many_arguments)]
    fn blas_bf16(&self, b: &Blas, w: &DevMat, xb: u64, y: u64, ys: usize, n: usize, accumulate: bool) -> Result<(), CudaError> {
        if n == 0 || w.rows == 0 || w.cols == 0 {
            return Ok(());
        }
        let (one, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
        let k = w.cols as i32;
        use cs::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let gemm = |a: u64, lda: usize, rows: usize, c: u64| -> Result<(), CudaError> {
            self.timed("blas_gemm_bf16", || unsafe {
                cr::gemm_ex(
                    b.handle,
                    CUBLAS_OP_T,
                    CUBLAS_OP_N,
                    rows as i32,
                    n as i32,
                    k,
                    &one as *const f32 as *const _,
                    a as *const _,
                    cs::cudaDataType::CUDA_R_16BF,
                    lda as i32,
                    xb as *const _,
                    cs::cudaDataType::CUDA_R_16BF,
                    k,
                    &beta as *const f32 as *const _,
                    c as *mut _,
                    cs::cudaDataType::CUDA_R_32F,
                    ys as i32,
                    cs::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
                .map_err(blas_err("cublasGemmEx"))
            })
        };
        if w.ty == GgmlType::BF16 {
            return gemm(w.ptr, w.row_bytes / 2, w.rows, y);
        }
        // Row slices of at most SLICE_ELEMS dequantized elements (whole matrix when it fits).
        let slice = (SLICE_ELEMS.load(Ordering::Relaxed) / w.cols).clamp(1, w.rows);
        let wb = scratch(self, &b.wbuf, slice * w.cols)?;
        for r0 in (0..w.rows).step_by(slice) {
            let rc = slice.min(w.rows - r0);
            self.dqb_rows(w, r0, rc, wb)?;
            gemm(wb, w.cols, rc, y + (r0 * 4) as u64)?;
        }
        Ok(())
    }

    /// Rows `r0 .. r0 + rc` of `w` dequantized by `dqb_TY` to packed bf16 at `out` (`rc × cols`
    /// elements): one launch, so at most `i32::MAX` threads (one per 32-element chunk, or per
    /// element for float types).
    fn dqb_rows(&self, w: &DevMat, r0: usize, rc: usize, out: u64) -> Result<(), CudaError> {
        let per_row = if w.ty.block_elems() == 1 { w.cols } else { w.cols / 32 };
        let threads = rc * per_row;
        if threads >= i32::MAX as usize {
            return Err(CudaError::Shape(format!("matmul_blas: {rc} rows of {} columns in one slice", w.cols)));
        }
        let wp = w.ptr + (r0 * w.row_bytes) as u64;
        let tn = w.ty.name().to_ascii_lowercase();
        self.launch(&format!("dqb_{tn}"), (threads.div_ceil(256) as u32, 1, 1), 256, 0, &[Arg::P(wp), Arg::L(w.row_bytes as i64), Arg::I(rc as i32), Arg::I(w.cols as i32), Arg::P(out)])
    }
}

/// Refuses strides shorter than the rows they hold and sizes past cuBLAS's `int`.
fn blas_shape(w: &DevMat, xs: usize, ys: usize, n: usize) -> Result<(), CudaError> {
    if xs < w.cols || ys < w.rows || n > i32::MAX as usize || w.cols > i32::MAX as usize || n.saturating_mul(w.cols) >= i32::MAX as usize {
        return Err(CudaError::Shape(format!("matmul_blas: {n} x {} input stride {xs}, {} outputs stride {ys}", w.cols, w.rows)));
    }
    Ok(())
}
