//! cuBLASLt for the dense prefill products' bf16 GEMMs, with the algorithm chosen once per
//! token bucket. `cublasGemmEx` picks (and caches) a kernel per exact shape, and the first call
//! at a token count the process has not seen costs several milliseconds a prefill
//! (docs/CUDA.md, cuBLAS section): with prefix caching nearly every agent request's uncached
//! part has such a count. Here the heuristic is asked once for the bucket's largest count
//! (counts rounded up to [`BUCKET`]) and its algorithm reused for every count in the bucket; a
//! call the algorithm refuses falls back to `cublasGemmEx`. On by default
//! (`MINIMAX_BLAS_LT=0` turns it off).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublaslt::result as lr;
use cudarc::cublaslt::sys as ls;

use super::env_flag::EnvFlag;

static BLAS_LT: EnvFlag = EnvFlag::new("MINIMAX_BLAS_LT", true);

/// Whether the bf16 GEMMs go through [`Lt`] (`MINIMAX_BLAS_LT`, or what [`set_blas_lt`] set).
pub fn blas_lt() -> bool {
    BLAS_LT.get()
}

/// Overrides [`blas_lt`] (A/B runs and tests; `None` = back to the environment).
pub fn set_blas_lt(on: Option<bool>) {
    BLAS_LT.set(on);
}

/// Token counts share an algorithm in buckets of this many.
pub const BUCKET: usize = 64;

/// Shape of one bf16 GEMM `C[m × n] (+)= op(A)[m × k] · B[k × n]` (column-major, A transposed:
/// A stored `k × m` with leading dimension `lda`, B `k × n` packed, C `m × n` with `ldc`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct LtShape {
    pub m: usize,
    pub k: usize,
    pub lda: usize,
    pub ldc: usize,
    pub accumulate: bool,
}

/// A cuBLASLt handle, the GEMM descriptor and the algorithm cache (by shape and bucket; `None`:
/// the heuristic offered nothing, use `cublasGemmEx`).
pub struct Lt {
    handle: ls::cublasLtHandle_t,
    desc: ls::cublasLtMatmulDesc_t,
    pref: ls::cublasLtMatmulPreference_t,
    workspace: (u64, usize),
    algos: Mutex<HashMap<(LtShape, usize), Option<ls::cublasLtMatmulAlgo_t>>>,
}

// Used by one thread at a time (see `Blas`); the cache has its own lock.
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        unsafe {
            let _ = lr::destroy_matmul_pref(self.pref);
            let _ = lr::destroy_matmul_desc(self.desc);
            let _ = lr::destroy_handle(self.handle);
        }
    }
}

/// A layout descriptor destroyed on drop.
struct Layout(ls::cublasLtMatrixLayout_t);
impl Drop for Layout {
    fn drop(&mut self) {
        unsafe {
            let _ = lr::destroy_matrix_layout(self.0);
        }
    }
}

fn layout(ty: ls::cudaDataType, rows: usize, cols: usize, ld: usize) -> Result<Layout, String> {
    lr::create_matrix_layout(ty, rows as u64, cols as u64, ld as i64).map(Layout).map_err(|e| format!("cublasLtMatrixLayoutCreate: {:?}", e.0))
}

impl Lt {
    /// A handle with a bf16 × bf16 → f32 descriptor (f32 compute and scale, A transposed) and a
    /// preference for `workspace` (address, bytes; the caller's, shared with cuBLAS in stream
    /// order) and 16-byte alignment. Err: libcublasLt missing or a call failed.
    pub fn new(workspace: (u64, usize)) -> Result<Self, String> {
        if !unsafe { ls::is_culib_present() } {
            return Err("libcublasLt not found".into());
        }
        let handle = lr::create_handle().map_err(|e| format!("cublasLtCreate: {:?}", e.0))?;
        let desc = match lr::create_matmul_desc(ls::cublasComputeType_t::CUBLAS_COMPUTE_32F, ls::cudaDataType::CUDA_R_32F) {
            Ok(d) => d,
            Err(e) => {
                unsafe {
                    let _ = lr::destroy_handle(handle);
                }
                return Err(format!("cublasLtMatmulDescCreate: {:?}", e.0));
            }
        };
        let pref = match lr::create_matmul_pref() {
            Ok(p) => p,
            Err(e) => {
                unsafe {
                    let _ = lr::destroy_matmul_desc(desc);
                    let _ = lr::destroy_handle(handle);
                }
                return Err(format!("cublasLtMatmulPreferenceCreate: {:?}", e.0));
            }
        };
        let lt = Self { handle, desc, pref, workspace, algos: Mutex::new(HashMap::new()) };
        let op_t: i32 = 1; // CUBLAS_OP_T
        let ws = workspace.1 as u64;
        let align: u32 = 16;
        unsafe {
            let set_d = |a, v: *const c_void, n| lr::set_matmul_desc_attribute(desc, a, v, n);
            set_d(ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, &op_t as *const i32 as _, 4).map_err(|e| format!("TRANSA: {:?}", e.0))?;
            use ls::cublasLtMatmulPreferenceAttributes_t as P;
            let set_p = |a, v: *const c_void, n| lr::set_matmul_pref_attribute(pref, a, v, n);
            set_p(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws as *const u64 as _, 8).map_err(|e| format!("workspace: {:?}", e.0))?;
            for a in [P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES] {
                set_p(a, &align as *const u32 as _, 4).map_err(|e| format!("alignment: {:?}", e.0))?;
            }
        }
        Ok(lt)
    }

    /// The algorithm for `s` at the bucket of `n` tokens (asked of the heuristic on first use).
    fn algo(&self, s: LtShape, n: usize) -> Result<Option<ls::cublasLtMatmulAlgo_t>, String> {
        let nb = n.div_ceil(BUCKET).max(1) * BUCKET;
        if let Some(a) = self.algos.lock().unwrap().get(&(s, nb)) {
            return Ok(*a);
        }
        let (a, b, c) = (layout(ls::cudaDataType::CUDA_R_16BF, s.k, s.m, s.lda)?, layout(ls::cudaDataType::CUDA_R_16BF, s.k, nb, s.k)?, layout(ls::cudaDataType::CUDA_R_32F, s.m, nb, s.ldc)?);
        let h = unsafe { lr::get_matmul_algo_heuristic(self.handle, self.desc, a.0, b.0, c.0, c.0, self.pref) };
        let algo = h.ok().map(|r| r.algo);
        self.algos.lock().unwrap().insert((s, nb), algo);
        Ok(algo)
    }

    /// Algorithms chosen so far (shape × bucket pairs).
    pub fn cached(&self) -> usize {
        self.algos.lock().unwrap().len()
    }

    /// `C (+)= op(A) · B` for `n` tokens on `stream` with the bucket's algorithm. Ok(false): no
    /// algorithm for this bucket, or cuBLASLt refused this call (nothing was enqueued); the
    /// caller runs `cublasGemmEx` instead.
    ///
    /// # Safety
    /// `a`, `b`, `c` must be device buffers of the shape's sizes on `stream`'s context.
    pub unsafe fn gemm(&self, s: LtShape, n: usize, a: u64, b: u64, c: u64, stream: ls::cudaStream_t) -> Result<bool, String> {
        let Some(algo) = self.algo(s, n)? else { return Ok(false) };
        let (la, lb, lc) = (layout(ls::cudaDataType::CUDA_R_16BF, s.k, s.m, s.lda)?, layout(ls::cudaDataType::CUDA_R_16BF, s.k, n, s.k)?, layout(ls::cudaDataType::CUDA_R_32F, s.m, n, s.ldc)?);
        let (one, beta) = (1f32, if s.accumulate { 1f32 } else { 0f32 });
        let r = unsafe {
            lr::matmul(
                self.handle,
                self.desc,
                &one as *const f32 as _,
                &beta as *const f32 as _,
                a as *const c_void,
                la.0,
                b as *const c_void,
                lb.0,
                c as *const c_void,
                lc.0,
                c as *mut c_void,
                lc.0,
                &algo,
                self.workspace.0 as *mut c_void,
                self.workspace.1,
                stream,
            )
        };
        match r {
            Ok(()) => Ok(true),
            Err(e) if e.0 == ls::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED || e.0 == ls::cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE => Ok(false),
            Err(e) => Err(format!("cublasLtMatmul: {:?}", e.0)),
        }
    }
}
