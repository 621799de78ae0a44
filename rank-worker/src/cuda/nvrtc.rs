//! Kernel sources (embedded at build time) and their run-time compilation with NVRTC to
//! CUBIN for one GPU architecture, with an on-disk cache keyed by source hash, architecture
//! and NVRTC version, so a restart does not recompile.

use std::ffi::{CStr, CString, c_char, c_int};
use std::path::PathBuf;

use cudarc::nvrtc::sys;

use super::error::CudaError;

/// Prepended to every module: types, conversions, warp reductions (no headers needed).
pub const PRELUDE: &str = include_str!("../../../kernels/common.cuh");

/// Every kernel module: (name, source without the prelude).
pub const MODULES: &[(&str, &str)] = &[
    ("quant_matvec", include_str!("../../../kernels/quant_matvec.cu")),
    ("norm_rope", include_str!("../../../kernels/norm_rope.cu")),
    ("attention", include_str!("../../../kernels/attention.cu")),
    ("moe", include_str!("../../../kernels/moe.cu")),
    ("fast", concat!(include_str!("../../../kernels/fast.cu"), include_str!("../../../kernels/mbarrier.cuh"), include_str!("../../../kernels/stream.cu"), include_str!("../../../kernels/gstream.cu"), include_str!("../../../kernels/mvx.cu"))),
    ("fast_kq", concat!(include_str!("../../../kernels/mbarrier.cuh"), include_str!("../../../kernels/fast_kq.cu"))),
    ("sampling", include_str!("../../../kernels/sampling.cu")),
    // Tensor-core GEMM: quant_matvec.cu in front for its dequantizers (its own kernels left
    // out), built once per precision (1 or 3 bf16 passes) so the two compile in parallel.
    ("quant_matmul", concat!("#define QMV_NO_KERNELS\n#define MM_PASSES 1\n", include_str!("../../../kernels/quant_matvec.cu"), include_str!("../../../kernels/quant_matmul.cu"))),
    ("quant_matmul_x3", concat!("#define QMV_NO_KERNELS\n#define MM_PASSES 3\n", include_str!("../../../kernels/quant_matvec.cu"), include_str!("../../../kernels/quant_matmul.cu"))),
    ("tp", include_str!("../../../kernels/tp.cu")),
];

/// Whether libnvrtc can be loaded; checked before any NVRTC call so a missing library is an
/// error, not a panic inside the bindings.
pub fn ensure_nvrtc() -> Result<(), CudaError> {
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::LibraryMissing {
            lib: "libnvrtc",
            hint: "install the CUDA toolkit (or the nvidia-cuda-nvrtc wheel) and put its lib directory on LD_LIBRARY_PATH",
        })
    }
}

/// NVRTC's (major, minor) version.
pub fn version() -> Result<(i32, i32), CudaError> {
    ensure_nvrtc()?;
    let (mut maj, mut min) = (0 as c_int, 0 as c_int);
    unsafe { sys::nvrtcVersion(&mut maj, &mut min) }
        .result()
        .map_err(|e| CudaError::Nvrtc { call: "nvrtcVersion", code: format!("{:?}", e.0) })?;
    Ok((maj, min))
}

/// The full source NVRTC compiles for `module`.
pub fn full_source(src: &str) -> String {
    format!("{PRELUDE}\n#line 1\n{src}")
}

/// FNV-1a 64-bit: a stable hash for cache keys (std's hasher is not stable across releases).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Options every module is compiled with.
fn options(arch: u32) -> Vec<String> {
    vec![
        format!("--gpu-architecture=sm_{arch}"),
        "--std=c++17".into(),
        "-lineinfo".into(),
        // The one-token decode attention's ring depth, which the host mirrors (its shared memory).
        format!("-DAT_NST1={}", super::fast::attn_tn_stages(arch)),
    ]
}

/// Compiles one module to a CUBIN for `sm_{arch}` (e.g. 90, 120).
pub fn compile(module: &str, src: &str, arch: u32) -> Result<Vec<u8>, CudaError> {
    ensure_nvrtc()?;
    let nv = |call: &'static str| move |e: cudarc::nvrtc::result::NvrtcError| CudaError::Nvrtc { call, code: format!("{:?}", e.0) };
    let full = CString::new(full_source(src)).map_err(|_| CudaError::Shape(format!("{module}: NUL in source")))?;
    let name = CString::new(format!("{module}.cu")).unwrap();
    let opts: Vec<CString> = options(arch).into_iter().map(|o| CString::new(o).unwrap()).collect();
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    unsafe {
        let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
        sys::nvrtcCreateProgram(&mut prog, full.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null())
            .result()
            .map_err(nv("nvrtcCreateProgram"))?;
        let compiled = sys::nvrtcCompileProgram(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()).result();
        let out = match compiled {
            Err(_) => {
                let mut n = 0usize;
                sys::nvrtcGetProgramLogSize(prog, &mut n);
                let mut log = vec![0 as c_char; n.max(1)];
                sys::nvrtcGetProgramLog(prog, log.as_mut_ptr());
                let log = CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned();
                Err(CudaError::Compile { module: module.to_string(), arch, log })
            }
            Ok(()) => {
                let mut n = 0usize;
                let r = sys::nvrtcGetCUBINSize(prog, &mut n).result().map_err(nv("nvrtcGetCUBINSize"));
                r.and_then(|()| {
                    let mut bin = vec![0u8; n];
                    sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut c_char)
                        .result()
                        .map_err(nv("nvrtcGetCUBIN"))
                        .map(|()| bin)
                })
            }
        };
        sys::nvrtcDestroyProgram(&mut prog);
        out
    }
}

/// Where compiled kernels are cached: `$MINIMAX_KERNEL_CACHE`, else
/// `$XDG_CACHE_HOME/minimax-serve/kernels`, else `~/.cache/minimax-serve/kernels`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("MINIMAX_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("minimax-serve").join("kernels"))
}

/// Cache file name for one module build: the key covers source, options, arch and NVRTC.
fn cache_key(module: &str, src: &str, arch: u32, nvrtc: (i32, i32)) -> String {
    let mut key = full_source(src).into_bytes();
    key.extend(options(arch).join(" ").bytes());
    format!("{module}-sm{arch}-nvrtc{}.{}-{:016x}.cubin", nvrtc.0, nvrtc.1, fnv1a(&key))
}

/// How a module's CUBIN was obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Cache,
    Compiled,
}

/// Compiles every module for `sm_{arch}` in parallel (one thread per module), using and
/// filling the disk cache. Returns (module name, cubin, origin) in [`MODULES`] order.
pub fn build_all(arch: u32) -> Result<Vec<(&'static str, Vec<u8>, Origin)>, CudaError> {
    let ver = version()?;
    let dir = cache_dir();
    std::thread::scope(|s| {
        let handles: Vec<_> = MODULES
            .iter()
            .map(|&(name, src)| {
                let dir = dir.clone();
                s.spawn(move || -> Result<(&'static str, Vec<u8>, Origin), CudaError> {
                    let path = dir.as_ref().map(|d| d.join(cache_key(name, src, arch, ver)));
                    if let Some(p) = &path
                        && let Ok(bin) = std::fs::read(p)
                        && !bin.is_empty()
                    {
                        return Ok((name, bin, Origin::Cache));
                    }
                    let bin = compile(name, src, arch)?;
                    if let Some(p) = &path {
                        // Write to a temporary name and rename, so concurrent ranks never read
                        // a half-written file; a cache that cannot be written is not an error.
                        let _ = std::fs::create_dir_all(p.parent().unwrap());
                        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
                        if std::fs::write(&tmp, &bin).is_ok() {
                            let _ = std::fs::rename(&tmp, p);
                        }
                    }
                    Ok((name, bin, Origin::Compiled))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("kernel compile thread panicked")).collect()
    })
}
