//! Flash-style prefill attention (`flash_*` in kernels/attention.cu): tiles of query rows of one
//! sequence and one KV-head group against K/V tiles of the paged cache on tensor cores, online
//! softmax in f32. [`Gpu::attention`] takes it for steps with enough new tokens per sequence;
//! decode-sized steps and the f32 cache keep the per-token kernel.

use super::error::CudaError;
use super::gpu::{Arg, AttnArgs, Gpu, KvDtype};

/// Query rows ((token, head) pairs of one KV-head group) per block; the grid's x extent.
pub const FLASH_ROWS: usize = 64;

/// Fewest new tokens of one sequence (the step's largest) for which [`Gpu::attention`] takes
/// the flash kernel, so decode steps keep the per-token kernel. Measured (docs/CUDA.md): flash
/// is faster even at one token per sequence at context 4096; 1 is the candidate once verified
/// at model level.
pub const FLASH_MIN_TOKENS: usize = 8;

/// Head widths the flash kernel is instantiated for (q/k and v widths equal).
pub const FLASH_HEAD_DIMS: [usize; 3] = [32, 64, 128];

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
    /// Causal paged GQA attention with the flash kernel. Needs `a.seq_start` (tokens of one
    /// sequence contiguous in the flat batch), a 16-bit cache, equal q/k and v head widths of
    /// 32, 64 or 128, 16-byte aligned caches and 8-byte aligned q/out rows.
    pub fn flash_attention(&self, dt: KvDtype, a: &AttnArgs) -> Result<(), CudaError> {
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
        if a.nt == 0 || a.max_seq_tokens == 0 {
            return Ok(());
        }
        let group = a.heads / a.kv_heads;
        let n_tiles = (a.max_seq_tokens * group).div_ceil(FLASH_ROWS);
        let sl2 = a.scale * std::f32::consts::LOG2_E;
        self.launch(
            &format!("flash_{}_{}", dt.suffix(), a.hd),
            (n_tiles as u32, a.kv_heads as u32, a.n_seqs as u32),
            128,
            0,
            &[
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
            ],
        )
    }

    /// Whether [`Gpu::attention`] takes the flash kernel for this call.
    pub fn flash_chosen(dt: KvDtype, a: &AttnArgs) -> bool {
        a.max_seq_tokens >= FLASH_MIN_TOKENS && flash_unsupported(dt, a).is_none()
    }
}
