//! One GPU: its context and stream, the compiled kernel modules, and typed launch wrappers
//! for every kernel. Wrappers take raw device addresses (`u64`) plus strides so callers can
//! address sub-ranges of buffers freely; they check what the kernels assume (sizes, alignment)
//! and return errors instead of launching something that would read out of bounds.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits};
use minimax_shared::model::GatingFunc;
use minimax_shared::quant::GgmlType;

use super::error::CudaError;
use super::nvrtc::{self, Origin};

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvDtype {
    /// IEEE half: 11 significant bits, the default (K and V are O(1)-scaled here).
    #[default]
    F16,
    /// bfloat16: f32's range with 8 significant bits.
    BF16,
    /// f32: exact; twice the memory. For checks against f32 references (rounding K/V to 16
    /// bits can flip MoE routing near-ties, which no tolerance on logits absorbs).
    F32,
}

impl KvDtype {
    pub(crate) fn suffix(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::BF16 => "bf16",
            KvDtype::F32 => "f32",
        }
    }

    /// Bytes per cached element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F16 | KvDtype::BF16 => 2,
            KvDtype::F32 => 4,
        }
    }
}

/// A kernel argument (passed by value).
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// A device address.
    P(u64),
    I(i32),
    L(i64),
    U(u32),
    F(f32),
    /// A 128-byte CUtensorMap passed by value (`__grid_constant__`; see `tma_experts`).
    M([u64; 16]),
}

/// The arguments of the dense `y[n] = W x[n]` kernels (`mv_*` and `mm_*`): W (address, row
/// bytes, rows, cols), x and its stride, y and its stride, the number of vectors and whether to
/// accumulate into y.
pub(super) fn mat_args(w: &DevMat, x: u64, xs: usize, y: u64, ys: usize, n: usize, accumulate: bool) -> [Arg; 10] {
    [
        Arg::P(w.ptr),
        Arg::L(w.row_bytes as i64),
        Arg::I(w.rows as i32),
        Arg::I(w.cols as i32),
        Arg::P(x),
        Arg::L(xs as i64),
        Arg::P(y),
        Arg::L(ys as i64),
        Arg::I(n as i32),
        Arg::I(accumulate as i32),
    ]
}

/// A quantized weight matrix in device memory: `rows` rows of `cols` elements of `ty`, or,
/// for a 3-D expert tensor, `n_experts` such matrices `expert_stride` bytes apart.
#[derive(Clone, Copy, Debug)]
pub struct DevMat {
    pub ptr: u64,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    pub n_experts: usize,
    pub expert_stride: usize,
}

impl DevMat {
    /// Bytes of the whole tensor.
    pub fn n_bytes(&self) -> usize {
        self.n_experts.max(1) * self.rows * self.row_bytes
    }
}

/// Timing of the start-up kernel build.
#[derive(Clone, Debug)]
pub struct BuildReport {
    pub arch: u32,
    pub nvrtc: (i32, i32),
    pub seconds: f64,
    pub cached: usize,
    pub compiled: usize,
}

/// A CUDA device with the project's kernels loaded.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub name: String,
    /// Compute capability as major * 10 + minor (90 on H100/H200, 120 on RTX Blackwell).
    pub arch: u32,
    pub build: BuildReport,
    modules: Vec<(&'static str, Arc<CudaModule>)>,
    funcs: Mutex<HashMap<String, CudaFunction>>,
    /// Dynamic shared memory each kernel has been allowed above the default 48 KB (see
    /// [`Gpu::launch_func`]).
    smem_allowed: Mutex<HashMap<String, u32>>,
    /// When set, every launch is bracketed by timing events (kernel name, start, end): the
    /// benchmark's per-kernel split. Never set while a graph is being captured.
    prof: Mutex<Option<Vec<(String, CudaEvent, CudaEvent)>>>,
    /// Programmatic dependent launch for the fast path's kernels (see [`Gpu::launch_pdl`]).
    pub pdl: bool,
    /// Rows per warp of the fused expert gate/up kernel (4, 2 or 1; `MINIMAX_GU`).
    pub gu_rows: usize,
    /// cuBLAS for the dense prefill products, created on first use (`None`: not available;
    /// see [`Gpu::blas`]).
    pub(super) blas: OnceLock<Option<super::blas::Blas>>,
    /// Partial sums and arrival counters of the K-split `mvx_q8_0` products (see
    /// [`Gpu::mvx_plan`]); allocated with the device so no step allocates (counters zero).
    pub(super) mvx_scratch: (CudaSlice<f32>, CudaSlice<u32>),
    /// Streaming multiprocessors and the opt-in shared memory a block may have, read once at
    /// creation: tile and kernel choices ask for them at every prefill launch.
    pub(super) n_sms: usize,
    pub(super) optin_smem: usize,
}

/// Checks that the CUDA driver library can be loaded (instead of a panic in the bindings).
pub fn ensure_driver() -> Result<(), CudaError> {
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::LibraryMissing { lib: "libcuda", hint: "no NVIDIA driver found (is this a GPU machine? is libcuda.so.1 on the loader path?)" })
    }
}

fn ceil_div(a: usize, b: usize) -> u32 {
    a.div_ceil(b) as u32
}

const MV_WARPS: usize = 4;

impl Gpu {
    /// Opens device `ordinal`, compiles (or loads from cache) every kernel module for its
    /// architecture, and loads them.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        ensure_driver()?;
        nvrtc::ensure_nvrtc()?;
        let ctx = CudaContext::new(ordinal)?;
        // Graph capture fails with cudarc's per-buffer event tracking; one stream, no events.
        unsafe { ctx.disable_event_tracking() };
        let (maj, min) = ctx.compute_capability()?;
        let arch = (maj * 10 + min) as u32;
        let name = ctx.name()?;
        let t0 = Instant::now();
        let built = nvrtc::build_all(arch)?;
        let nv = nvrtc::version()?;
        let mut modules = Vec::new();
        let (mut cached, mut compiled) = (0, 0);
        for (m, bin, origin) in built {
            match origin {
                Origin::Cache => cached += 1,
                Origin::Compiled => compiled += 1,
            }
            modules.push((m, ctx.load_module(cudarc::nvrtc::Ptx::from_binary(bin))?));
        }
        let build = BuildReport { arch, nvrtc: nv, seconds: t0.elapsed().as_secs_f64(), cached, compiled };
        tracing::info!(device = %name, arch, ?nv, secs = build.seconds, cached, compiled, "CUDA kernels ready");
        // A created stream (not the legacy default stream, which cannot be captured into a
        // CUDA graph).
        let stream = ctx.new_stream()?;
        let gu_rows = match std::env::var("MINIMAX_GU").as_deref() {
            Ok("1") => 1,
            Ok("2") => 2,
            _ => 4,
        };
        let pdl = arch >= 90 && std::env::var("MINIMAX_PDL").map(|v| v != "0").unwrap_or(true);
        let mvx_scratch = (stream.alloc_zeros::<f32>(super::fast::MVX_PART_CAP)?, stream.alloc_zeros::<u32>(super::fast::MVX_CNT_CAP)?);
        use cudarc::driver::sys::CUdevice_attribute as A;
        let n_sms = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as usize;
        let optin_smem = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?.max(0) as usize;
        let gpu = Self { ctx, stream, name, arch, build, modules, funcs: Mutex::new(HashMap::new()), smem_allowed: Mutex::new(HashMap::new()), prof: Mutex::new(None), pdl, gu_rows, blas: OnceLock::new(), mvx_scratch, n_sms, optin_smem };
        if super::mem_pool::POOL_KEEP.get() {
            gpu.set_pool_keep(true)?;
        }
        Ok(gpu)
    }

    /// The kernel `name`, looked up once in the loaded modules.
    pub fn func(&self, name: &str) -> Result<CudaFunction, CudaError> {
        let mut f = self.funcs.lock().unwrap();
        if let Some(k) = f.get(name) {
            return Ok(k.clone());
        }
        for (_, m) in &self.modules {
            if let Ok(k) = m.load_function(name) {
                f.insert(name.to_string(), k.clone());
                return Ok(k);
            }
        }
        Err(CudaError::MissingKernel(name.to_string()))
    }

    /// The kernel `name`, allowed `smem` bytes of dynamic shared memory: a launch above the
    /// default 48 KB needs the function's limit raised first, done here once per kernel (the
    /// attribute persists) so that callers only pass the size. A driver call, not a stream
    /// operation: allowed while a graph is captured.
    fn launch_func(&self, name: &str, smem: u32) -> Result<CudaFunction, CudaError> {
        use cudarc::driver::sys::CUfunction_attribute;
        let f = self.func(name)?;
        if smem > 48 * 1024 {
            let mut allowed = self.smem_allowed.lock().unwrap();
            if allowed.get(name).is_none_or(|&s| s < smem) {
                f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)?;
                allowed.insert(name.to_string(), smem);
            }
        }
        Ok(f)
    }

    /// Launches kernel `name` on the stream (`smem` bytes of dynamic shared memory).
    pub fn launch(&self, name: &str, grid: (u32, u32, u32), block: u32, smem: u32, args: &[Arg]) -> Result<(), CudaError> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let f = self.launch_func(name, smem)?;
        let mut b = self.stream.launch_builder(&f);
        for a in args {
            match a {
                Arg::P(v) => b.arg(v),
                Arg::I(v) => b.arg(v),
                Arg::L(v) => b.arg(v),
                Arg::U(v) => b.arg(v),
                Arg::F(v) => b.arg(v),
                Arg::M(v) => b.arg(v),
            };
        }
        let cfg = LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: smem };
        self.timed(name, || {
            unsafe { b.launch(cfg) }?;
            Ok(())
        })
    }

    /// Launches kernel `name` with programmatic dependent launch (PDL, Hopper and newer): the
    /// kernel may start while the previous one on the stream drains, and must begin with
    /// `pdl_wait()` (griddepcontrol.wait) before touching memory. Only the fast path's kernels
    /// in kernels/fast.cu do; every other kernel goes through [`Gpu::launch`]. Off (plain
    /// launch) before sm_90 or with `MINIMAX_PDL=0`.
    pub fn launch_pdl(&self, name: &str, grid: (u32, u32, u32), block: u32, smem: u32, args: &[Arg]) -> Result<(), CudaError> {
        if !self.pdl || self.prof.lock().unwrap().is_some() || args.iter().any(|a| matches!(a, Arg::M(_))) {
            return self.launch(name, grid, block, smem, args);
        }
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        use cudarc::driver::sys;
        let f = self.launch_func(name, smem)?;
        self.ctx.bind_to_thread()?;
        let mut vals: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::P(v) => v,
                Arg::I(v) => v as u32 as u64,
                Arg::L(v) => v as u64,
                Arg::U(v) => v as u64,
                Arg::F(v) => v.to_bits() as u64,
                Arg::M(_) => unreachable!("tensor maps take the plain launch above"),
            })
            .collect();
        let mut params: Vec<*mut std::ffi::c_void> = vals.iter_mut().map(|v| v as *mut u64 as *mut std::ffi::c_void).collect();
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let r = unsafe { sys::cuLaunchKernelEx(&cfg, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) };
        r.result()?;
        Ok(())
    }

    /// Runs `f` (stream work: a kernel launch, a cuBLAS call), timed as `name` when launches are
    /// being timed (see [`Gpu::profile_begin`]).
    pub fn timed(&self, name: &str, f: impl FnOnce() -> Result<(), CudaError>) -> Result<(), CudaError> {
        if self.prof.lock().unwrap().is_none() {
            return f();
        }
        // The lock is not held while `f` runs: it may launch kernels, which take it.
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.stream.record_event(flags)?;
        f()?;
        let end = self.stream.record_event(flags)?;
        if let Some(events) = self.prof.lock().unwrap().as_mut() {
            events.push((name.to_string(), start, end));
        }
        Ok(())
    }

    /// Starts timing every launch (see [`Gpu::profile_end`]).
    pub fn profile_begin(&self) {
        *self.prof.lock().unwrap() = Some(Vec::new());
    }

    /// Stops timing and returns (kernel name, milliseconds) per launch since
    /// [`Gpu::profile_begin`], in launch order.
    pub fn profile_end(&self) -> Result<Vec<(String, f32)>, CudaError> {
        let events = self.prof.lock().unwrap().take().unwrap_or_default();
        self.sync()?;
        let mut out = Vec::with_capacity(events.len());
        for (n, a, b) in events {
            out.push((n, a.elapsed_ms(&b)?));
        }
        Ok(out)
    }

    /// Waits for the stream and surfaces any asynchronous error.
    pub fn sync(&self) -> Result<(), CudaError> {
        self.stream.synchronize()?;
        Ok(())
    }

    /// Device address of a buffer.
    pub fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.stream).0
    }

    /// Copies host data into a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.clone_htod(data)?)
    }

    /// A zeroed device buffer of `n` elements (at least one, so it has an address).
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.alloc_zeros::<T>(n.max(1))?)
    }

    /// Copies a device buffer back to the host.
    pub fn download<T: DeviceRepr>(&self, s: &CudaSlice<T>) -> Result<Vec<T>, CudaError> {
        Ok(self.stream.clone_dtoh(s)?)
    }

    /// Fills `n` 32-bit words at `p` with `bits` (tests poison outputs with NaN).
    pub fn fill_u32(&self, p: u64, n: usize, bits: u32) -> Result<(), CudaError> {
        self.launch("fill_u32", (ceil_div(n, 256), 1, 1), 256, 0, &[Arg::P(p), Arg::L(n as i64), Arg::U(bits)])
    }

    fn check_type(&self, ty: GgmlType, what: &str) -> Result<String, CudaError> {
        if !ty.is_supported() {
            return Err(CudaError::Unsupported { ty, what: what.to_string() });
        }
        Ok(ty.name().to_ascii_lowercase())
    }

    fn check_x(&self, ty: GgmlType, x: u64, xs: usize) -> Result<(), CudaError> {
        let float = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        if !float && (x % 16 != 0 || xs % 4 != 0) {
            return Err(CudaError::Shape(format!("matvec input must be 16-byte aligned with a stride multiple of 4 (x {x:#x}, stride {xs})")));
        }
        Ok(())
    }

    /// `y[v] = W x[v]` (or `+=` with `accumulate`) for `nvec` f32 vectors `xs` apart, outputs
    /// `ys` apart (strides in elements).
    #[allow(clippy::too_many_arguments)]
    /// Above [`super::matmul::GEMM_MIN_TOKENS`] vectors this is the tensor-core GEMM
    /// ([`Gpu::matmul`]) when its alignment holds.
    pub fn matvec(&self, w: &DevMat, x: u64, xs: usize, y: u64, ys: usize, nvec: usize, accumulate: bool) -> Result<(), CudaError> {
        let tn = self.check_type(w.ty, "matvec")?;
        self.check_x(w.ty, x, xs)?;
        if nvec > super::matmul::GEMM_MIN_TOKENS && self.gemm_unfit(w, x, xs).is_none() {
            return self.matmul(w, x, xs, y, ys, nvec, accumulate);
        }
        let nt = if nvec == 1 { 1 } else { 8 };
        let grid = (ceil_div(w.rows, MV_WARPS), ceil_div(nvec, nt), 1);
        self.launch(
            &format!("mv_{tn}_{nt}"),
            grid,
            (32 * MV_WARPS) as u32,
            0,
            &mat_args(w, x, xs, y, ys, nvec, accumulate),
        )
    }

    /// For each pair `p < npairs`: `y[p] = W[ids[p]] x[p / x_div]` with `W` an expert tensor.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_experts(&self, w: &DevMat, ids: u64, x: u64, xs: usize, x_div: usize, y: u64, ys: usize, npairs: usize) -> Result<(), CudaError> {
        let tn = self.check_type(w.ty, "expert matvec")?;
        self.check_x(w.ty, x, xs)?;
        if npairs > 65535 {
            return Err(CudaError::Shape(format!("{npairs} expert pairs in one launch (max 65535)")));
        }
        self.launch(
            &format!("mve_{tn}"),
            (ceil_div(w.rows, MV_WARPS), npairs as u32, 1),
            (32 * MV_WARPS) as u32,
            0,
            &[
                Arg::P(w.ptr),
                Arg::L(w.row_bytes as i64),
                Arg::L(w.expert_stride as i64),
                Arg::I(w.rows as i32),
                Arg::I(w.cols as i32),
                Arg::P(ids),
                Arg::P(x),
                Arg::L(xs as i64),
                Arg::I(x_div as i32),
                Arg::P(y),
                Arg::L(ys as i64),
            ],
        )
    }

    /// Dequantizes rows `ids[0..n]` (i32) of `w` into f32 rows `os` apart (embedding lookup).
    pub fn dequant_rows(&self, w: &DevMat, ids: u64, n: usize, out: u64, os: usize) -> Result<(), CudaError> {
        self.dequant_rows_fed(w, ids, n, out, os, 0)
    }

    /// [`Gpu::dequant_rows`] where an id `-1 - j` reads row `feed[j]` (i32 at device address
    /// `feed`, 0 = none): overlapped decode feeds the token the previous step drew on the device.
    pub fn dequant_rows_fed(&self, w: &DevMat, ids: u64, n: usize, out: u64, os: usize, feed: u64) -> Result<(), CudaError> {
        let tn = self.check_type(w.ty, "dequant")?;
        self.launch(
            &format!("dq_{tn}"),
            (n as u32, 1, 1),
            256,
            0,
            &[Arg::P(w.ptr), Arg::L(w.row_bytes as i64), Arg::P(ids), Arg::I(w.cols as i32), Arg::P(out), Arg::L(os as i64), Arg::P(feed)],
        )
    }

    /// RMSNorm of `nrows` rows of width `n` (in place when `x == y`).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(&self, x: u64, xs: usize, w: u64, y: u64, ys: usize, nrows: usize, n: usize, eps: f32) -> Result<(), CudaError> {
        // The float4 form (one read of x, vector loads) where widths and addresses allow it.
        let v4 = n % 4 == 0 && n <= 4 * 8 * 256 && xs % 4 == 0 && ys % 4 == 0 && (x | w | y) % 16 == 0;
        self.launch(
            if v4 { "rms_norm_v4" } else { "rms_norm" },
            (nrows as u32, 1, 1),
            256,
            0,
            &[Arg::P(x), Arg::L(xs as i64), Arg::P(w), Arg::P(y), Arg::L(ys as i64), Arg::I(n as i32), Arg::F(eps)],
        )
    }

    /// Partial NeoX RoPE in place on `nrows` rows of `heads` heads of width `hd`; row t is
    /// at position `pos[t]` (i32 device array).
    #[allow(clippy::too_many_arguments)]
    pub fn rope(&self, x: u64, xs: usize, nrows: usize, heads: usize, hd: usize, rot: usize, pos: u64, theta: f32) -> Result<(), CudaError> {
        // The kernel keeps one row's angles in shared memory (ROPE_MAX_HALF pairs).
        if rot > hd || rot % 2 != 0 || rot > 512 {
            return Err(CudaError::Shape(format!("rotary dims {rot} of head dim {hd}")));
        }
        self.launch(
            "rope_neox",
            (nrows as u32, 1, 1),
            128,
            0,
            &[Arg::P(x), Arg::L(xs as i64), Arg::I(heads as i32), Arg::I(hd as i32), Arg::I(rot as i32), Arg::P(pos), Arg::F(theta)],
        )
    }

    /// `dst[i] = src[idx[i]]` for `nrows` rows of `n` floats.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_rows(&self, src: u64, ss: usize, idx: u64, dst: u64, ds: usize, n: usize, nrows: usize) -> Result<(), CudaError> {
        self.launch("gather_rows", (nrows as u32, 1, 1), 256, 0, &[Arg::P(src), Arg::L(ss as i64), Arg::P(idx), Arg::P(dst), Arg::L(ds as i64), Arg::I(n as i32)])
    }

    /// Stores `nt` tokens' K (`kw` wide) and V (`vw` wide) rows at cache slots `slots[t]`.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_store(&self, dt: KvDtype, k: u64, v: u64, kw: usize, vw: usize, slots: u64, kc: u64, vc: u64, nt: usize) -> Result<(), CudaError> {
        self.launch(
            &format!("kv_store_{}", dt.suffix()),
            (nt as u32, 1, 1),
            256,
            0,
            &[Arg::P(k), Arg::P(v), Arg::I(kw as i32), Arg::I(vw as i32), Arg::P(slots), Arg::P(kc), Arg::P(vc)],
        )
    }

    /// Causal paged GQA attention for `nt` query rows: the flash kernel (cuda/flash.rs) when
    /// `a` gives per-sequence token ranges and some sequence has enough new tokens, else the
    /// per-token kernel.
    pub fn attention(&self, dt: KvDtype, a: &AttnArgs) -> Result<(), CudaError> {
        if Gpu::flash_chosen(dt, a) {
            return self.flash_attention(dt, a);
        }
        self.attention_per_token(dt, a)
    }

    /// Causal paged GQA attention, one block per (query head, token); see kernels/attention.cu.
    pub fn attention_per_token(&self, dt: KvDtype, a: &AttnArgs) -> Result<(), CudaError> {
        if a.hd > 256 || a.vd > 256 || a.kv_heads == 0 || a.heads % a.kv_heads != 0 {
            return Err(CudaError::Shape(format!("attention: head dims {}/{} (max 256), heads {}/{}", a.hd, a.vd, a.heads, a.kv_heads)));
        }
        self.launch(
            &format!("attn_{}", dt.suffix()),
            (a.heads as u32, a.nt as u32, 1),
            128,
            0,
            &[
                Arg::P(a.q),
                Arg::L(a.qs as i64),
                Arg::P(a.kc),
                Arg::P(a.vc),
                Arg::P(a.pos),
                Arg::P(a.seq),
                Arg::P(a.pt_off),
                Arg::P(a.page_tables),
                Arg::I(a.page_size as i32),
                Arg::I(a.heads as i32),
                Arg::I(a.kv_heads as i32),
                Arg::I(a.hd as i32),
                Arg::I(a.vd as i32),
                Arg::F(a.scale),
                Arg::P(a.out),
                Arg::L(a.os as i64),
            ],
        )
    }

    /// Router: per token, top-`k` experts of `e` (ids i32, weights f32, `k` per token).
    #[allow(clippy::too_many_arguments)]
    pub fn route(&self, logits: u64, bias: u64, e: usize, k: usize, gating: GatingFunc, ids: u64, w: u64, nt: usize) -> Result<(), CudaError> {
        if k > e || e * 8 > 48 * 1024 {
            return Err(CudaError::Shape(format!("router: top-{k} of {e} experts")));
        }
        let g = match gating {
            GatingFunc::Sigmoid => 2,
            GatingFunc::Softmax => 1,
        };
        self.launch(
            "moe_route",
            (nt as u32, 1, 1),
            32,
            (e * 8) as u32,
            &[Arg::P(logits), Arg::P(bias), Arg::I(e as i32), Arg::I(k as i32), Arg::I(g), Arg::P(ids), Arg::P(w)],
        )
    }

    /// `out = silu(g) * u` over `n` elements.
    pub fn silu_mul(&self, g: u64, u: u64, out: u64, n: usize) -> Result<(), CudaError> {
        self.launch("silu_mul", (ceil_div(n, 256), 1, 1), 256, 0, &[Arg::P(g), Arg::P(u), Arg::P(out), Arg::L(n as i64)])
    }

    /// `hidden[t] += sum_j w[t,j] d[t*k+j]` for `nt` tokens of width `h`.
    pub fn moe_combine(&self, hidden: u64, d: u64, w: u64, k: usize, h: usize, nt: usize) -> Result<(), CudaError> {
        self.launch("moe_combine", (nt as u32, 1, 1), 256, 0, &[Arg::P(hidden), Arg::P(d), Arg::P(w), Arg::I(k as i32), Arg::I(h as i32)])
    }
}

/// Arguments of [`Gpu::attention`] (device addresses and sizes).
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnArgs {
    /// Queries, `nt` rows `qs` apart, `heads * hd` wide (normed and rotated).
    pub q: u64,
    pub qs: usize,
    /// This layer's K and V cache (`[slot][kv_head][hd or vd]`, elements of the KV dtype).
    pub kc: u64,
    pub vc: u64,
    /// Per token (i32): position and sequence index.
    pub pos: u64,
    pub seq: u64,
    /// Per sequence (i32): offset of its page table in `page_tables` (u32).
    pub pt_off: u64,
    pub page_tables: u64,
    pub page_size: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub hd: usize,
    pub vd: usize,
    pub scale: f32,
    /// Output rows (`heads * vd` wide), `os` apart.
    pub out: u64,
    pub os: usize,
    pub nt: usize,
    /// Per sequence (i32, `n_seqs + 1` entries): index of its first token in the flat batch
    /// (a sequence's tokens are contiguous), then `nt`. 0 (not given) = per-token kernel only.
    pub seq_start: u64,
    pub n_seqs: usize,
    /// Most new tokens of one sequence in this step (flash grid size and kernel choice).
    pub max_seq_tokens: usize,
}
