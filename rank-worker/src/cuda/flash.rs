//! Flash-style prefill attention (`flash_*` / `flash64_*` in kernels/attention.cu): tiles of
//! query rows of one sequence and one KV-head group against K/V tiles of the paged cache on
//! tensor cores, online softmax in f32. [`Gpu::attention`] takes it for steps with enough new
//! tokens per sequence; decode-sized steps and the f32 cache keep the per-token kernel.

use super::env_flag::EnvFlag;
use super::error::CudaError;
use super::gpu::{Arg, AttnArgs, Gpu, KvDtype};

/// Query rows ((token, head) pairs of one KV-head group) per block of the main kernel
/// (`flash_*`: 4 warps x two m16 tiles); the grid's x extent is rows / this.
pub const FLASH_ROWS: usize = 128;

/// Query rows per block of the 64-row kernel (`flash64_*`: one m16 tile per warp, the previous
/// kernel; `MINIMAX_FLASH_WIDE=0` only: measured slower at every launch size, docs/CUDA.md).
pub const FLASH64_ROWS: usize = 64;

/// Keys per K/V tile of the main kernel (its shared-memory size depends on it).
const FLASH_KEYS: usize = 64;

/// `MINIMAX_FLASH_WIDE=0` makes [`Gpu::attention`] take the 64-row kernel (A/B runs); default 1:
/// the 128-row kernel.
pub static FLASH_WIDE: EnvFlag = EnvFlag::new("MINIMAX_FLASH_WIDE", true);

/// `MINIMAX_FLASH_DB=0` keeps the 128-row kernel's single K/V buffers where the double-buffered
/// form (`flashdb_*`) fits the card's shared memory (sm_90: yes; sm_120: no).
pub static FLASH_DB: EnvFlag = EnvFlag::new("MINIMAX_FLASH_DB", true);

/// `MINIMAX_FLASH_SPLIT=N` (2..=8; unset or 0: off, the default; A/B only: slower on an H200, a
/// 512-token prefill 56.0 → 58.4-60.7 ms, docs/CUDA.md): a flash launch
/// of the 128-row kernels with fewer blocks than two per SM, whose longest sequence has at least
/// [`FLASH_SPLIT_MIN_TOKENS`] new tokens, splits each row tile's keys over N blocks
/// (`flashs_*` / `flashsdb_*`) and merges the partials (`flash_merge`): the heaviest tile of a
/// short prefill otherwise runs its key tiles one after another while SMs idle.
pub fn flash_split_env() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::env::var("MINIMAX_FLASH_SPLIT").ok().and_then(|v| v.parse::<usize>().ok()).filter(|n| (2..=8).contains(n)).unwrap_or(0))
}

/// Fewest new tokens of the launch's longest sequence for which [`flash_split_env`] splits.
pub const FLASH_SPLIT_MIN_TOKENS: usize = 256;

/// Which flash kernel runs a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashKernel {
    /// `flash_*`: 128 rows a block, Q in dynamic shared memory (half the shared-memory reads
    /// per FLOP).
    Rows128,
    /// `flash64_*`: 64 rows a block, Q in registers.
    Rows64,
    /// `flashdb_*`: [`FlashKernel::Rows128`] with two K and two V buffers, each fetched a whole
    /// tile ahead (104 KB of shared memory at head width 128: sm_90's two blocks an SM).
    Rows128Db,
}

impl FlashKernel {
    /// Rows per block.
    pub fn rows(self) -> usize {
        match self {
            FlashKernel::Rows128 | FlashKernel::Rows128Db => FLASH_ROWS,
            FlashKernel::Rows64 => FLASH64_ROWS,
        }
    }

    /// Dynamic shared memory for head width `d` (bytes): Q rows plus one K and one V tile,
    /// rows padded by 8 halves.
    pub fn smem(self, d: usize) -> usize {
        match self {
            FlashKernel::Rows128 => (FLASH_ROWS + 2 * FLASH_KEYS) * (d + 8) * 2,
            FlashKernel::Rows128Db => (FLASH_ROWS + 4 * FLASH_KEYS) * (d + 8) * 2,
            FlashKernel::Rows64 => 0,
        }
    }
}

/// Fewest new tokens of one sequence (the step's largest) for which [`Gpu::attention`] takes
/// the flash kernel, so decode steps keep the per-token kernel. Measured (docs/CUDA.md): flash
/// is faster even at one token per sequence at context 4096; 1 is the candidate once verified
/// at model level.
pub const FLASH_MIN_TOKENS: usize = 8;

/// Head widths the flash kernel is instantiated for (q/k and v widths equal).
pub const FLASH_HEAD_DIMS: [usize; 3] = [32, 64, 128];

/// The arguments every flash kernel takes first (q, caches, metadata, scale, output, tiles).
fn flash_args(a: &AttnArgs, group: usize, sl2: f32, n_tiles: usize) -> [Arg; 15] {
    [
        Arg::P(a.q),
        Arg::L(a.qs as i64),
        Arg::P(a.kc),
        Arg::P(a.vc),
        Arg::P(a.pos),
        Arg::P(a.seq_start),
        Arg::P(a.pt_off),
        Arg::P(a.page_tables),
        Arg::I(a.page_size as i32),
        Arg::I(a.kv_heads as i32),
        Arg::I(group as i32),
        Arg::F(sl2),
        Arg::P(a.out),
        Arg::L(a.os as i64),
        Arg::I(n_tiles as i32),
    ]
}

/// Why the flash kernel cannot run `a` with a `dt` cache (`None`: it can).
pub fn flash_unsupported(dt: KvDtype, a: &AttnArgs) -> Option<String> {
    if dt == KvDtype::F32 {
        return Some("f32 KV cache (kept exact: per-token kernel)".into());
    }
    if a.hd != a.vd || !FLASH_HEAD_DIMS.contains(&a.hd) {
        return Some(format!("head dims {}/{} (flash: equal, one of {FLASH_HEAD_DIMS:?})", a.hd, a.vd));
    }
    if a.seq_start == 0 || a.n_seqs == 0 {
        return Some("no per-sequence token ranges (AttnArgs::seq_start)".into());
    }
    None
}

impl Gpu {
    /// Causal paged GQA attention with the flash kernel [`Gpu::flash_kernel`] picks. Needs
    /// `a.seq_start` (tokens of one sequence contiguous in the flat batch), a 16-bit cache,
    /// equal q/k and v head widths of 32, 64 or 128, 16-byte aligned caches and 8-byte aligned
    /// q/out rows.
    pub fn flash_attention(&self, dt: KvDtype, a: &AttnArgs) -> Result<(), CudaError> {
        let k = self.flash_kernel(a);
        let n = flash_split_env();
        if n >= 2 && k != FlashKernel::Rows64 && a.max_seq_tokens >= FLASH_SPLIT_MIN_TOKENS && a.kv_heads > 0 {
            let blocks = (a.max_seq_tokens * (a.heads / a.kv_heads)).div_ceil(k.rows()) * a.kv_heads * a.n_seqs;
            if blocks < 2 * self.sm_count() {
                return self.flash_attention_split(dt, a, k, n);
            }
        }
        self.flash_attention_with(dt, a, k)
    }

    /// The flash kernel for `a`: the 128-row kernel, or the 64-row one with
    /// `MINIMAX_FLASH_WIDE=0`. The 128-row kernel measured faster at every launch size tried on
    /// an H200, down to 8 decode tokens (64 blocks), so no size rule (docs/CUDA.md).
    /// The double-buffered form where it fits the card (`MINIMAX_FLASH_DB`).
    pub fn flash_kernel(&self, a: &AttnArgs) -> FlashKernel {
        if !FLASH_WIDE.get() {
            FlashKernel::Rows64
        } else if FLASH_DB.get() && FlashKernel::Rows128Db.smem(a.hd) <= self.smem_optin() {
            FlashKernel::Rows128Db
        } else {
            FlashKernel::Rows128
        }
    }

    /// [`Gpu::flash_attention`] with the kernel given (tests and A/B runs).
    pub fn flash_attention_with(&self, dt: KvDtype, a: &AttnArgs, k: FlashKernel) -> Result<(), CudaError> {
        let Some((group, n_tiles, sl2)) = self.flash_prep(dt, a, k)? else {
            return Ok(());
        };
        let name = match k {
            FlashKernel::Rows128 => format!("flash_{}_{}", dt.suffix(), a.hd),
            FlashKernel::Rows64 => format!("flash64_{}_{}", dt.suffix(), a.hd),
            FlashKernel::Rows128Db => format!("flashdb_{}_{}", dt.suffix(), a.hd),
        };
        let smem = k.smem(a.hd);
        self.launch(
            &name,
            (n_tiles as u32, a.kv_heads as u32, a.n_seqs as u32),
            128,
            smem as u32,
            &flash_args(a, group, sl2, n_tiles),
        )
    }

    /// Checks a flash launch's arguments (errors, never a bad launch); `None` when there is
    /// nothing to compute, else (q heads per KV head, row tiles, softmax scale × log2 e).
    fn flash_prep(&self, dt: KvDtype, a: &AttnArgs, k: FlashKernel) -> Result<Option<(usize, usize, f32)>, CudaError> {
        if let Some(why) = flash_unsupported(dt, a) {
            return Err(CudaError::Shape(format!("flash attention: {why}")));
        }
        if a.kv_heads == 0 || a.heads % a.kv_heads != 0 || a.page_size == 0 {
            return Err(CudaError::Shape(format!("flash attention: heads {}/{}, page size {}", a.heads, a.kv_heads, a.page_size)));
        }
        if a.kc % 16 != 0 || a.vc % 16 != 0 || a.q % 8 != 0 || a.out % 8 != 0 || a.qs % 2 != 0 || a.os % 2 != 0 {
            return Err(CudaError::Shape(format!(
                "flash attention: alignment (caches {:#x}/{:#x} need 16 bytes; q {:#x}, out {:#x} 8 bytes; strides {}/{} even)",
                a.kc, a.vc, a.q, a.out, a.qs, a.os
            )));
        }
        if a.qs < a.heads * a.hd || a.os < a.heads * a.vd {
            return Err(CudaError::Shape(format!("flash attention: row strides {}/{} narrower than {} heads x {}", a.qs, a.os, a.heads, a.hd)));
        }
        if a.n_seqs > 65535 || a.kv_heads > 65535 {
            return Err(CudaError::Shape(format!("flash attention: {} sequences x {} KV heads (max 65535 each)", a.n_seqs, a.kv_heads)));
        }
        let smem = k.smem(a.hd);
        if smem > self.smem_optin() {
            return Err(CudaError::Shape(format!("flash {k:?}: {smem} bytes of shared memory (the card allows {})", self.smem_optin())));
        }
        if a.nt == 0 || a.max_seq_tokens == 0 {
            return Ok(None);
        }
        let group = a.heads / a.kv_heads;
        Ok(Some((group, (a.max_seq_tokens * group).div_ceil(k.rows()), a.scale * std::f32::consts::LOG2_E)))
    }

    /// [`Gpu::flash_attention_with`] with each row tile's keys split over `nsplit` blocks
    /// (`flashs_*` / `flashsdb_*`, 128-row kernels only) and the partials merged by
    /// `flash_merge` (tests and A/B runs; [`flash_split_env`] makes `flash_attention` take it).
    pub fn flash_attention_split(&self, dt: KvDtype, a: &AttnArgs, k: FlashKernel, nsplit: usize) -> Result<(), CudaError> {
        if k == FlashKernel::Rows64 || nsplit == 0 || nsplit > 64 {
            return Err(CudaError::Shape(format!("split flash attention: kernel {k:?}, {nsplit} splits")));
        }
        let Some((group, n_tiles, sl2)) = self.flash_prep(dt, a, k)? else {
            return Ok(());
        };
        let name = match k {
            FlashKernel::Rows128Db => format!("flashsdb_{}_{}", dt.suffix(), a.hd),
            _ => format!("flashs_{}_{}", dt.suffix(), a.hd),
        };
        // Partials: nsplit x tokens x heads x (hd + 2) f32, every entry written by its split.
        let part = unsafe { self.stream.alloc::<f32>(nsplit * a.nt * a.heads * (a.hd + 2))? };
        self.launch(
            &name,
            ((n_tiles * nsplit) as u32, a.kv_heads as u32, a.n_seqs as u32),
            128,
            k.smem(a.hd) as u32,
            &[flash_args(a, group, sl2, n_tiles).as_slice(), &[Arg::I(nsplit as i32), Arg::P(self.ptr(&part))]].concat(),
        )?;
        self.launch(
            "flash_merge",
            (a.nt as u32, a.heads as u32, 1),
            a.hd as u32,
            0,
            &[Arg::P(self.ptr(&part)), Arg::I(nsplit as i32), Arg::I(a.nt as i32), Arg::I(a.heads as i32), Arg::I(a.hd as i32), Arg::F(sl2), Arg::P(a.out), Arg::L(a.os as i64)],
        )
    }

    /// Whether [`Gpu::attention`] takes the flash kernel for this call.
    pub fn flash_chosen(dt: KvDtype, a: &AttnArgs) -> bool {
        a.max_seq_tokens >= FLASH_MIN_TOKENS && flash_unsupported(dt, a).is_none()
    }
}
