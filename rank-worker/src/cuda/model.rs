//! `CudaModel`: the whole MiniMax-M2 forward on one GPU, behind the same batch contract as
//! the CPU reference (`forward(&ForwardBatch) -> ForwardOutput`, same validation). Weights
//! are copied from the memory-mapped GGUF to device memory in their quantized form;
//! activations are f32; the paged KV cache is f16 (or bf16, or f32 for exact checks).

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use minimax_shared::forward::{ForwardBatch, ForwardOutput, LogitsRow};
use minimax_shared::gguf::GgufModel;
use minimax_shared::model::{ModelConfig, names};
use minimax_shared::quant::{self, GgmlType};

use super::error::CudaError;
use super::fast::{FastLayer, FastWs, MAX_FAST_TOKENS, fast_plan, fast_router, nsplit_for};
use super::gpu::{Arg, AttnArgs, DevMat, Gpu, KvDtype};
use minimax_shared::model::synthetic::SyntheticSpec;
use crate::cpu::KvSpec;
use crate::partition::Partition;
use super::nccl::NcclComm;
use super::upload::Uploader;

#[path = "synthetic_part.rs"]
mod synthetic_part;
// Device sampling reductions: a child module so it can read the fast path's logits buffer.
#[path = "sampling.rs"]
pub mod sampling;
use sampling::StepLogits;

/// Options for [`CudaModel::load`].
#[derive(Clone, Copy, Debug)]
pub struct CudaOptions {
    /// CUDA device ordinal.
    pub device: usize,
    pub kv_dtype: KvDtype,
    /// Steps of up to [`MAX_FAST_TOKENS`] tokens take the fast path (q8 activations, fused
    /// MoE, split-K attention) when the model's shapes and types allow it. Off = always the
    /// exact path (f32 activations, bit-exact dequantization).
    pub fast_decode: bool,
    /// Replay fast-path steps from CUDA graphs (one per step size).
    pub graphs: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self { device: 0, kv_dtype: KvDtype::default(), fast_decode: true, graphs: true }
    }
}

struct Layer {
    attn_norm: u64,
    wq: DevMat,
    wk: DevMat,
    wv: DevMat,
    wo: DevMat,
    q_norm: u64,
    k_norm: u64,
    ffn_norm: u64,
    router: DevMat,
    bias: u64,
    gate: DevMat,
    up: DevMat,
    down: DevMat,
}

/// Totals of a weight upload.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadStats {
    pub tensors: usize,
    pub bytes: usize,
    pub seconds: f64,
}

impl LoadStats {
    /// Achieved host-to-device rate.
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / 1e9 / self.seconds.max(1e-9)
    }
}

/// The whole model on one GPU plus its paged KV cache.
pub struct CudaModel {
    gpu: Gpu,
    cfg: ModelConfig,
    kv_dtype: KvDtype,
    page_size: usize,
    n_pages: usize,
    /// Owns the device memory every `DevMat`/address below points into.
    _weights: Vec<CudaSlice<u8>>,
    embd: DevMat,
    out_norm: u64,
    head: DevMat,
    layers: Vec<Layer>,
    kc: Vec<CudaSlice<u8>>,
    vc: Vec<CudaSlice<u8>>,
    stats: LoadStats,
    opts: CudaOptions,
    /// Why the fast path does not apply (None = it does).
    fast_off: Option<String>,
    fast: Option<FastWs>,
    /// This rank's share (whole model, or a tensor-parallel slice of every layer).
    part: Partition,
    /// Local head, KV-head and expert-intermediate counts (the whole model's when tp = 1).
    heads: usize,
    kv_heads: usize,
    ff: usize,
    /// The tensor-parallel communicator (set at JOIN; None for a world of one).
    comm: Option<NcclComm>,
    /// Benchmark switch: the fast path's tensor-parallel all-reduces are enqueued (true, the
    /// only correct setting) or skipped (kernel time alone; wrong results).
    tp_collectives: bool,
    /// Per layer, bf16 copies of q, k, v and o for prefill's cuBLAS products (empty: none; see
    /// [`CudaModel::build_dense_bf16`]), and the memory they live in.
    dense_bf16: Vec<[DevMat; 4]>,
    _dense_bufs: Vec<CudaSlice<u16>>,
    /// The next fast step's device-fed tokens: (batch sequence, pick index of the previous
    /// step's draw it feeds). Set by [`CudaModel::set_device_feed`], taken by the step.
    feed: Vec<(usize, usize)>,
}

/// Why bf16 copies of the attention weights are kept or not (`MINIMAX_DENSE_BF16`): `1` always
/// (a load error when memory lacks), `0` never, unset: when the memory left after the weights
/// and the KV cache holds them with [`DENSE_BF16_HEADROOM`] to spare.
fn dense_bf16_policy() -> Option<bool> {
    match std::env::var("MINIMAX_DENSE_BF16").as_deref() {
        Ok("1") => Some(true),
        Ok("0") => Some(false),
        _ => None,
    }
}

/// Benchmark switch: prefill uses the bf16 copies when kept (true) or dequantizes per call.
pub static DENSE_COPIES: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_DENSE_BF16_USE", true);

/// Device memory that must stay free after the bf16 copies (prefill's activations, ~1.3 GB
/// for a 4,096-token M2.7 chunk, cuBLAS workspace, graphs): 3 GiB.
const DENSE_BF16_HEADROOM: usize = 3 << 30;

/// Per-step device buffers.
struct Step {
    tokens: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    seq: CudaSlice<i32>,
    slots: CudaSlice<i32>,
    pt_off: CudaSlice<i32>,
    pts: CudaSlice<u32>,
    out_idx: CudaSlice<i32>,
    /// Per sequence: its first token in the flat batch, then nt (flash attention).
    seq_start: CudaSlice<i32>,
}

impl CudaModel {
    /// Loads the whole model onto one GPU and allocates a zeroed KV cache.
    pub fn load(model: Arc<GgufModel>, kv: KvSpec, opts: CudaOptions) -> Result<Self, CudaError> {
        let cfg = ModelConfig::from_gguf(&model)?;
        Self::load_part(model, Partition::whole(&cfg), kv, opts)
    }

    /// Loads this rank's share of the model: the whole model, or a tensor-parallel slice of
    /// every layer (`Partition::tensor`: q/k/v rows of this rank's heads, o-proj columns,
    /// expert gate/up rows and down columns of its intermediate slice, the same slicing as
    /// the CPU backend). Embedding, router, norms and lm_head are replicated. A pipeline
    /// partition (`Partition::pipeline*`) loads only its contiguous layer range, the token
    /// embedding on the first stage and the final norm + lm_head on the last.
    pub fn load_part(model: Arc<GgufModel>, part: Partition, kv: KvSpec, opts: CudaOptions) -> Result<Self, CudaError> {
        let cfg = ModelConfig::from_gguf(&model)?;
        check_partition(&cfg, &part)?;
        let gpu = Gpu::new(opts.device)?;
        // Planned here, copied at `up.finish()` (upload.rs: pinned staging, parallel reads).
        let mut up = Uploader::new(&gpu, &model);
        let embd = if part.first_stage { up.mat(names::TOKEN_EMBD)? } else { absent_mat() };
        let (out_norm, head) = if part.last_stage {
            let head_name = if cfg.tied_embeddings { names::TOKEN_EMBD } else { names::OUTPUT };
            let head = if cfg.tied_embeddings && part.first_stage { embd } else { up.mat(head_name)? };
            (up.vec_f32(names::OUTPUT_NORM)?, head)
        } else {
            (0, absent_mat())
        };
        let mut layers = Vec::with_capacity(part.layers.len());
        let heads = part.tp_range(cfg.n_heads);
        let kvh = part.tp_range(cfg.n_kv_heads);
        let f = part.tp_range(cfg.expert_ff);
        let (hd, vd) = (cfg.head_dim, cfg.v_head_dim);
        let q_rows = heads.start * hd..heads.end * hd;
        let k_rows = kvh.start * hd..kvh.end * hd;
        for l in part.layers.clone() {
            let n = |s: &str| names::block(l, s);
            let (q_norm, _) = up.vec_f32_range(&n(names::ATTN_Q_NORM), q_rows.clone())?;
            let (k_norm, _) = up.vec_f32_range(&n(names::ATTN_K_NORM), k_rows.clone())?;
            layers.push(Layer {
                attn_norm: up.vec_f32(&n(names::ATTN_NORM))?,
                wq: up.mat_slice(&n(names::ATTN_Q), Some(q_rows.clone()), None)?,
                wk: up.mat_slice(&n(names::ATTN_K), Some(k_rows.clone()), None)?,
                wv: up.mat_slice(&n(names::ATTN_V), Some(kvh.start * vd..kvh.end * vd), None)?,
                wo: up.mat_slice(&n(names::ATTN_OUTPUT), None, Some(heads.start * vd..heads.end * vd))?,
                q_norm,
                k_norm,
                ffn_norm: up.vec_f32(&n(names::FFN_NORM))?,
                router: up.mat(&n(names::FFN_GATE_INP))?,
                bias: up.vec_f32(&n(names::EXP_PROBS_B))?,
                gate: up.mat_slice(&n(names::FFN_GATE_EXPS), Some(f.clone()), None)?,
                up: up.mat_slice(&n(names::FFN_UP_EXPS), Some(f.clone()), None)?,
                // Rows padded to whole fast-kernel chunks (IQ4_XS at tensor 2: 408 -> 544 bytes).
                down: up.mat_slice_padded(&n(names::FFN_DOWN_EXPS), None, Some(f.clone()), super::fast::down_row_multiple)?,
            });
        }
        let (bufs, stats) = up.finish()?;
        Self::finish(gpu, cfg, part, kv, opts, bufs, embd, out_norm, head, layers, stats)
    }

    /// Allocates the KV cache and decides on the fast path.
    #[allow(clippy::too_many_arguments)]
    fn finish(
        gpu: Gpu,
        cfg: ModelConfig,
        part: Partition,
        kv: KvSpec,
        opts: CudaOptions,
        bufs: Vec<CudaSlice<u8>>,
        embd: DevMat,
        out_norm: u64,
        head: DevMat,
        layers: Vec<Layer>,
        stats: LoadStats,
    ) -> Result<Self, CudaError> {
        let slots = kv.page_size * kv.n_pages;
        let mut kc = Vec::new();
        let mut vc = Vec::new();
        let (heads, kv_heads, ff) = (part.tp_range(cfg.n_heads).len(), part.tp_range(cfg.n_kv_heads).len(), part.tp_range(cfg.expert_ff).len());
        if layers.len() != part.layers.len() {
            return Err(CudaError::Shape(format!("{} layers loaded for the partition's {:?}", layers.len(), part.layers)));
        }
        // One K/V cache per layer this rank runs (a pipeline stage: its range only).
        for _ in 0..layers.len() {
            let eb = opts.kv_dtype.bytes();
            kc.push(gpu.zeros::<u8>(slots * kv_heads * cfg.head_dim * eb)?);
            vc.push(gpu.zeros::<u8>(slots * kv_heads * cfg.v_head_dim * eb)?);
        }
        let mut m = Self {
            gpu,
            cfg,
            kv_dtype: opts.kv_dtype,
            page_size: kv.page_size,
            n_pages: kv.n_pages,
            _weights: bufs,
            embd,
            out_norm,
            head,
            layers,
            kc,
            vc,
            stats,
            opts,
            fast_off: None,
            fast: None,
            feed: Vec::new(),
            part,
            heads,
            kv_heads,
            ff,
            comm: None,
            tp_collectives: true,
            dense_bf16: Vec::new(),
            _dense_bufs: Vec::new(),
        };
        let fl = m.fast_layers();
        m.fast_off = if !opts.fast_decode {
            Some("disabled by options".into())
        } else {
            fast_plan(&m.cfg, m.kv_dtype, &fl, &m.head).err()
        };
        match &m.fast_off {
            None => {
                m.fast = Some(FastWs::new(&m.gpu, &m.cfg, (2 * kv.n_pages).max(4096))?);
                tracing::info!("CUDA fast decode path on (steps of up to {MAX_FAST_TOKENS} tokens, graphs {})", opts.graphs);
            }
            Some(why) => tracing::info!("CUDA fast decode path off: {why}"),
        }
        m.warm_blas()?;
        m.build_dense_bf16()?;
        Ok(m)
    }

    /// Keeps bf16 copies of every layer's q, k, v and o weights (Q8_0 / IQ4_XS: prefill's cuBLAS
    /// products dequantize them per call, `dqb_*`, 4.5 ms of a 512-token M2.7 prefill on one H200)
    /// where the policy allows ([`dense_bf16_policy`]): the same values the per-call conversion
    /// produces, so prefill results do not change. 5.5 GB at M2.7 size (one GPU).
    fn build_dense_bf16(&mut self) -> Result<(), CudaError> {
        let policy = dense_bf16_policy();
        // The types the default (int8) precision sends through cuBLAS.
        let convertible = |w: &DevMat| matches!(w.ty, GgmlType::Q8_0 | GgmlType::IQ4_XS) && w.n_experts == 0 && w.cols % 32 == 0 && w.rows > 0;
        if policy == Some(false) || !super::blas::blas_on() || self.layers.is_empty() || !self.layers.iter().all(|l| [&l.wq, &l.wk, &l.wv, &l.wo].iter().all(|w| convertible(w))) {
            return Ok(());
        }
        let need: usize = self.layers.iter().map(|l| [&l.wq, &l.wk, &l.wv, &l.wo].iter().map(|w| w.rows * w.cols * 2).sum::<usize>()).sum();
        self.gpu.ctx.bind_to_thread()?;
        let (free, _) = cudarc::driver::result::mem_get_info()?;
        if policy.is_none() && free < need + DENSE_BF16_HEADROOM {
            tracing::info!(need_gb = need as f64 / 1e9, free_gb = free as f64 / 1e9, "bf16 copies of the attention weights not kept (memory); prefill dequantizes them per call");
            return Ok(());
        }
        let t = std::time::Instant::now();
        let mut copies = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let mut one = [l.wq, l.wk, l.wv, l.wo];
            for w in one.iter_mut() {
                // Every element is written by the conversion below.
                let buf = unsafe { self.gpu.stream.alloc::<u16>(w.rows * w.cols)? };
                let p = self.gpu.ptr(&buf);
                self.gpu.dequant_bf16(w, p)?;
                *w = DevMat { ptr: p, ty: GgmlType::BF16, rows: w.rows, cols: w.cols, row_bytes: w.cols * 2, n_experts: 0, expert_stride: 0 };
                self._dense_bufs.push(buf);
            }
            copies.push(one);
        }
        self.gpu.sync()?;
        self.dense_bf16 = copies;
        tracing::info!(gb = need as f64 / 1e9, free_gb_before = free as f64 / 1e9, ms = t.elapsed().as_secs_f64() * 1e3, "bf16 copies of the attention weights kept for prefill");
        Ok(())
    }

    /// Whether prefill's q, k, v and o products use the bf16 copies (built at load).
    pub fn dense_bf16_kept(&self) -> bool {
        !self.dense_bf16.is_empty()
    }

    /// Creates cuBLAS and runs the dense prefill products of one layer once on zeros (512 and
    /// 2048 tokens: chunk sizes of served prefill), so the first request does not pay for the
    /// handle, its workspace and the loading of the kernels cuBLAS picks (measured: a 512-token
    /// prompt's TTFT 436 ms on a fresh server against 84 ms of prefill). A failure here turns
    /// the cuBLAS path off for this process (with a warning) instead of failing the load.
    ///
    /// With [`super::blas::blas_warm_wide`] (the default) it runs every token count 64 j + r
    /// (r = 0, 1, 2, 4; from the cuBLAS threshold up to 4,096) instead: a prompt length cuBLAS
    /// has not seen cost 7-9 ms more on its first call (H200, `minimax-bench --first-calls`: 513
    /// tokens 64.8 ms, then 57.1), the same with eager module loading, and lengths next to one
    /// seen (514, 520 after 513) ~1 ms. With these counts warmed the extra is 3.6-5.3 ms (513:
    /// 60.9 then 57.3); the rest is per exact shape.
    fn warm_blas(&self) -> Result<(), CudaError> {
        let Some(l) = self.layers.first() else { return Ok(()) };
        let g = &self.gpu;
        let ns: Vec<usize> = if super::blas::blas_warm_wide() {
            let lo = super::blas::blas_min_tokens().max(1);
            (1..=64usize).flat_map(|j| [0usize, 1, 2, 4].map(|r| 64 * j + r)).filter(|&n| n >= lo && n <= 4096).collect()
        } else {
            vec![512, 2048]
        };
        let ws: Vec<&DevMat> = [&l.wq, &l.wk, &l.wv, &l.wo, &l.router].into_iter().filter(|w| ns.iter().all(|&n| g.blas_takes(w, n))).collect();
        if ws.is_empty() {
            return Ok(());
        }
        let t = std::time::Instant::now();
        let cols = ws.iter().map(|w| w.cols).max().unwrap_or(0);
        let rows = ws.iter().map(|w| w.rows).max().unwrap_or(0);
        let n = ns.iter().copied().max().unwrap_or(0);
        let x = g.zeros::<f32>(n * cols)?;
        let y = g.zeros::<f32>(n * rows)?;
        let run = || -> Result<(), CudaError> {
            for &n in &ns {
                for w in &ws {
                    g.matmul(w, g.ptr(&x), w.cols, g.ptr(&y), w.rows, n, false)?;
                }
            }
            g.sync()
        };
        match run() {
            Ok(()) => tracing::info!(ms = t.elapsed().as_secs_f64() * 1e3, token_counts = ns.len(), "cuBLAS ready for the dense prefill products"),
            Err(e) => {
                tracing::warn!(error = %e, "cuBLAS warm-up failed: dense prefill products use the built-in GEMMs");
                super::blas::set_blas(Some(false));
            }
        }
        Ok(())
    }

    fn fast_layers(&self) -> Vec<FastLayer> {
        self.layers
            .iter()
            .enumerate()
            .map(|(i, l)| FastLayer {
                attn_norm: l.attn_norm,
                wq: l.wq,
                wk: l.wk,
                wv: l.wv,
                wo: l.wo,
                q_norm: l.q_norm,
                k_norm: l.k_norm,
                ffn_norm: l.ffn_norm,
                router: l.router,
                bias: l.bias,
                gate: l.gate,
                up: l.up,
                down: l.down,
                kc: self.gpu.ptr(&self.kc[i]),
                vc: self.gpu.ptr(&self.vc[i]),
            })
            .collect()
    }

    /// A model with MiniMax-M2.7's dimensions and `spec`'s quant mix whose weights are
    /// allocated in their quantized form and filled on the device with random valid blocks
    /// (benchmarks only; routing on random weights is roughly uniform). Norm weights are
    /// uniform in [0.9, 1.1], the router's f32 weights in [-0.05, 0.05], its bias in [0, 0.01].
    pub fn synthetic(spec: &SyntheticSpec, kv: KvSpec, opts: CudaOptions, seed: u64) -> Result<Self, CudaError> {
        Self::synthetic_part(spec, Partition::whole(&spec.config()), kv, opts, seed)
    }

    /// Why the fast decode path is off for this model (None when it is on).
    pub fn fast_path_off(&self) -> Option<&str> {
        self.fast_off.as_deref()
    }

    /// Overlapped decode: in the next (fast) step, each `(batch sequence, pick)` feeds the
    /// draw the previous step's sampling merge left on the device at index `pick`
    /// ([`sampling::PendingReduce::pick_index`]), instead of its token (a placeholder). The
    /// embedding reads it there, so the next step is launched before the previous one's
    /// answer is read.
    pub fn set_device_feed(&mut self, feed: Vec<(usize, usize)>) {
        self.feed = feed;
    }

    /// Drops the captured fast-step graphs (they are captured again on the next step of each
    /// size): after a kernel choice changed (`fast::set_kernel_overrides`).
    pub fn clear_graphs(&mut self) {
        if let Some(ws) = self.fast.as_mut() {
            ws.graphs.clear();
        }
    }

    /// Turns fast-path decoding (and its graphs) on or off at run time (for A/B checks).
    pub fn set_fast(&mut self, fast: bool, graphs: bool) {
        self.opts.fast_decode = fast;
        self.opts.graphs = graphs;
    }

    /// Fills every layer's K and V cache with random values in [-1, 1) (benchmarks: decode at
    /// long context without running the prefill first).
    pub fn fill_kv_random(&mut self, seed: u64) -> Result<(), CudaError> {
        let ty = if self.kv_dtype == KvDtype::BF16 { quant::GgmlType::BF16 } else { quant::GgmlType::F16 };
        if self.kv_dtype == KvDtype::F32 {
            return Err(CudaError::Shape("fill_kv_random: f32 cache".into()));
        }
        for i in 0..self.kc.len() {
            let (k, v) = (self.gpu.ptr(&self.kc[i]), self.gpu.ptr(&self.vc[i]));
            self.gpu.fill_synthetic(k, ty, self.kc[i].len() / 2, seed ^ (2 * i as u64 + 1), -1.0, 1.0)?;
            self.gpu.fill_synthetic(v, ty, self.vc[i].len() / 2, seed ^ (2 * i as u64 + 2), -1.0, 1.0)?;
        }
        self.gpu.sync()
    }

    /// Bytes of all weights on the device.
    pub fn weight_bytes(&self) -> usize {
        self.stats.bytes
    }

    /// Bytes of weights one decode token reads: every dense matrix, the router, k experts'
    /// gate/up/down rows per layer, the output head (embedding rows are negligible).
    pub fn decode_weight_bytes(&self) -> usize {
        let k = self.cfg.n_experts_used;
        let per: usize = self
            .layers
            .iter()
            .map(|l| l.wq.n_bytes() + l.wk.n_bytes() + l.wv.n_bytes() + l.wo.n_bytes() + l.router.n_bytes() + k * (l.gate.expert_stride + l.up.expert_stride + l.down.expert_stride))
            .sum();
        per + self.head.n_bytes()
    }

    /// Whether a step of `nt` tokens takes the fast path (graphs, logits left on the device;
    /// device-fed tokens need it).
    pub fn fast_eligible(&self, nt: usize) -> bool {
        self.fast.is_some() && self.opts.fast_decode && nt >= 1 && nt <= MAX_FAST_TOKENS
    }

    /// Enqueues one fast step of `nt` tokens whose metadata is already in the workspace.
    /// `short`: every context of the step is at most `fast::ATTN_SHORT_MAX_CTX` and
    /// `fast::attn_short` is on (unsplit decode attention).
    /// `par`: the logits buffer the step writes (`FastWs::logits[par]`).
    fn enqueue_fast(&self, nt: usize, short: bool, par: usize) -> Result<(), CudaError> {
        let c = &self.cfg;
        let g = &self.gpu;
        let ws = self.fast.as_ref().unwrap();
        let p = |s: &CudaSlice<f32>| g.ptr(s);
        let t = MAX_FAST_TOKENS as u64;
        let meta = g.ptr(&ws.meta);
        let (m_tok, m_pos, m_seq, m_slot, m_ptoff, m_pts) = (meta, meta + 4 * t, meta + 8 * t, meta + 12 * t, meta + 16 * t, meta + 20 * t);
        let h = c.hidden;
        // This rank's widths (tensor parallelism: its heads / KV heads; the whole model's at tp 1).
        let (qw, kw, vw, ow) = (self.heads * c.head_dim, self.kv_heads * c.head_dim, self.kv_heads * c.v_head_dim, self.heads * c.v_head_dim);
        let (k, e) = (c.n_experts_used, c.n_experts);
        let (hid, nrm, xq, xd) = (p(&ws.hidden), p(&ws.normed), g.ptr(&ws.xq), p(&ws.xd));
        // Tensor parallelism: every rank holds the same residual `hid`. Rank 0 adds its o-proj
        // and MoE-down partials into it, the other ranks overwrite it with theirs, and an
        // in-place all-reduce of `hid` makes it the new residual everywhere (no extra add
        // kernel). The full-width q/k norm all-reduces per-token partial sums of squares.
        let tp = self.part.tp_world > 1;
        let lead = self.part.tp_rank == 0;
        let comm = if tp { Some(self.comm.as_ref().ok_or_else(|| CudaError::Shape("tensor-parallel rank has no NCCL communicator (JOIN first)".into()))?) } else { None };
        let all_reduce = |ptr: u64, n: usize| -> Result<(), CudaError> {
            match comm {
                // One-shot peer-memory kernel for these small tensors, NCCL otherwise.
                Some(cm) if self.tp_collectives => cm.all_reduce_sum_dev(g, ptr, n),
                _ => Ok(()),
            }
        };
        let ssp = p(&ws.ss);
        let (aq, ad, ids, wts) = (g.ptr(&ws.aq), p(&ws.ad), g.ptr(&ws.ids), p(&ws.wts));
        let kvs = if self.kv_dtype == KvDtype::BF16 { "bf16" } else { "f16" };
        let nsplit = if short { 1 } else { nsplit_for(nt) };
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        // One-token steps with fast::qk_fuse: no q/k norm launch; the attention normalizes,
        // rotates and stores q / k itself, with this step's RoPE table.
        let qk_fused = nt == 1 && !tp && super::fast::qk_fuse() && super::fast::attn_mma() && c.head_dim == 128 && c.v_head_dim == 128 && g.qk_fuse_fits(c.rotary_dim, qw, kw);
        if qk_fused {
            g.rope_table(m_pos, nt, c.rotary_dim, c.rope_theta, p(&ws.rope))?;
        }
        // Pipeline stages after the first find their input in `hidden` (received before the
        // step's graph); stages before the last stop after their layers (sent after it).
        if self.part.first_stage {
            g.dequant_rows_fed(&self.embd, m_tok, nt, hid, h, g.ptr(&ws.picks))?;
        }
        // MINIMAX_ATTN_FUSE=1: decode attention merges its splits in its last block.
        // Short contexts (fast::attn_short): one split whose block normalizes its own output.
        let acnt = if short || (super::fast::attn_fusion() && nsplit <= super::fast::ATTN_FUSE_MAX_SPLIT) { Some(g.ptr(&ws.acnt)) } else { None };
        // Whether xq / xd already hold this layer's attention norm (the previous layer's streamed
        // down ran it in its last block: fast::fuse_down_norm).
        let mut normed = false;
        // ... and in the x8 form (fast::norm_x8): the q/k/v takes the norm's 1 / rms itself.
        let mut normed_x8 = false;
        let fuse_router = super::fast::fuse_router_norm() && h % 128 == 0 && h <= super::fast::FUSED_NORM_MAX;
        let fuse_down = super::fast::fuse_down_norm() && !tp && super::stream::stream_on();
        // Timing attribution only (minimax-bench --skip-ab): launches left out of the step.
        use super::fast::skip as sk;
        let run = |part: u32| super::fast::skip_mask() & part == 0;
        for (li, l) in self.layers.iter().enumerate() {
            let x8_in = std::mem::take(&mut normed_x8);
            if !std::mem::take(&mut normed) && run(sk::ATTN_NORM) {
                g.norm_q8(hid, h, l.attn_norm, h, c.rms_eps, 0, 0, xq, xd, nt)?;
            }
            if run(sk::QKV) {
                let segs = [(&l.wq, p(&ws.q), qw), (&l.wk, p(&ws.k), kw), (&l.wv, p(&ws.v), vw)];
                if x8_in {
                    g.matvec_q8_x8(&segs, xq, xd, p(&ws.ss8), c.rms_eps, h)?;
                } else {
                    g.matvec_q8_any(&segs, xq, xd, h, nt, false)?;
                }
            }
            let (kc, vc) = (g.ptr(&self.kc[li]), g.ptr(&self.vc[li]));
            if tp {
                g.launch("tp_qk_sumsq", (nt as u32, 2, 1), 256, 0, &[Arg::P(p(&ws.q)), Arg::L(qw as i64), Arg::P(p(&ws.k)), Arg::L(kw as i64), Arg::I(qw as i32), Arg::I(kw as i32), Arg::P(ssp)])?;
                all_reduce(ssp, 2 * nt)?;
            }
            if run(sk::QK) && !qk_fused {
                let rows = super::fast::QkRows { q: p(&ws.q), k: p(&ws.k), v: p(&ws.v), qw, kw, vw, hd: c.head_dim, rot: c.rotary_dim };
                let mut qk_args = super::fast::qk_norm_rope_args(&rows, l.q_norm, l.k_norm, m_pos, c.rope_theta, c.rms_eps, m_slot, kc, vc);
                if tp {
                    qk_args.extend([Arg::P(ssp), Arg::I((c.n_heads * c.head_dim) as i32), Arg::I((c.n_kv_heads * c.head_dim) as i32)]);
                }
                g.launch_pdl(&super::fast::qk_norm_rope_name(tp, kvs), (nt as u32, 2, 1), 1024, 0, &qk_args)?;
            }
            if run(sk::ATTN) {
                let meta = (m_pos, m_seq, m_ptoff, m_pts);
                if qk_fused {
                    let qn = super::fast::QkNormIn { q: p(&ws.q), k: p(&ws.k), v: p(&ws.v), q_norm: l.q_norm, k_norm: l.k_norm, qw, kw, rot: c.rotary_dim, rope: p(&ws.rope), eps: c.rms_eps, slots: m_slot };
                    g.attn_decode_normed(kvs, &qn, kc, vc, meta, self.page_size, self.kv_heads, nsplit, scale, p(&ws.part), p(&ws.att), ow, xq, xd, acnt)?;
                } else {
                    g.attn_decode(kvs, p(&ws.q), qw, kc, vc, meta, self.page_size, self.kv_heads, nsplit, scale, p(&ws.part), p(&ws.att), ow, xq, xd, acnt, nt)?;
                }
            }
            if run(sk::O) {
                g.matvec_q8_any(&[(&l.wo, hid, h)], xq, xd, ow, nt, lead)?;
            }
            if tp {
                all_reduce(hid, nt * h)?;
            }
            use super::fast::{ROUTE_FAST_MAX_E, RouteMode, route_mode};
            let rmode = if e <= ROUTE_FAST_MAX_E && k <= 32 { route_mode() } else { RouteMode::Exact };
            // The down kernel reads whole 272-byte chunks: a rank's expert slice may be stored
            // padded (zero blocks); the activations then go `dn.cols` apart, pad left zero.
            let dn = DevMat { cols: l.down.row_bytes / l.down.ty.block_bytes() * l.down.ty.block_elems(), ..l.down };
            // Steps of several tokens: pairs grouped by expert, each chosen expert read once.
            let grouped = super::fast::use_grouped(nt, &l.gate, &dn, e);
            let normless = rmode == RouteMode::Fused && !fuse_router && super::fast::router_normless() && nt < super::fast::router_t4_min() && super::fast::normless_fits(&l.router, l.ffn_norm);
            // One token, normless router, streamed gate/up: the gate/up routes (fast::route_inline).
            let inline = normless && nt == 1 && !tp && !grouped && run(sk::ROUTE) && run(sk::GATE_UP) && super::fast::route_inline() && g.gate_up_routes(&l.gate, &l.up, k, e, dn.cols)?;
            if !run(sk::ROUTE) {
            } else if inline {
                g.router_f32n(&l.router, hid, l.ffn_norm, c.rms_eps, p(&ws.rl), l.bias, k, c.gating, xq, xd, p(&ws.rss))?;
            } else if fast_router(&l.router) && rmode == RouteMode::Fused && fuse_router {
                g.router_topk_norm_f32(&l.router, hid, h, l.ffn_norm, c.rms_eps, p(&ws.rl), e, l.bias, k, c.gating, ids, wts, g.ptr(&ws.rcnt), xq, xd, nt)?;
            } else if normless {
                g.router_topk_f32n(&l.router, hid, h, l.ffn_norm, c.rms_eps, p(&ws.rl), e, l.bias, k, c.gating, ids, wts, g.ptr(&ws.rcnt), xq, xd, p(&ws.rss), nt)?;
            } else if fast_router(&l.router) && rmode == RouteMode::Fused {
                g.norm_q8(hid, h, l.ffn_norm, h, c.rms_eps, nrm, h, xq, xd, nt)?;
                g.router_topk_f32(&l.router, nrm, h, p(&ws.rl), e, l.bias, k, c.gating, ids, wts, g.ptr(&ws.rcnt), nt)?;
            } else {
                g.norm_q8(hid, h, l.ffn_norm, h, c.rms_eps, nrm, h, xq, xd, nt)?;
                if fast_router(&l.router) {
                    g.router_f32(&l.router, nrm, h, p(&ws.rl), e, nt)?;
                } else {
                    g.matvec(&l.router, nrm, h, p(&ws.rl), e, nt, false)?;
                }
                if rmode == RouteMode::Exact {
                    g.route(p(&ws.rl), l.bias, e, k, c.gating, ids, wts, nt)?;
                } else {
                    g.route_fast(p(&ws.rl), l.bias, e, k, c.gating, ids, wts, nt)?;
                }
            }
            let (grp, nslots) = (g.ptr(&ws.grp), (nt * k).min(e));
            if !run(sk::GATE_UP) {
            } else if inline {
                let r = super::stream::StreamRoute { logits: p(&ws.rl), ss: p(&ws.rss), bias: l.bias, e, gating: super::fast::gating_code(c.gating), eps: c.rms_eps, ids, wts };
                g.moe_gate_up_stream_routed(&l.gate, &l.up, &r, k, xq, xd, aq, ad, dn.cols)?;
            } else if grouped {
                g.moe_group(ids, nt * k, e, grp)?;
                g.moe_gate_up_grp_any(&l.gate, &l.up, grp, e, nslots, k, xq, xd, aq, ad, dn.cols)?;
            } else {
                g.moe_gate_up_q8_any(&l.gate, &l.up, ids, k, xq, xd, aq, ad, nt * k, dn.cols)?;
            }
            if tp && !lead {
                memset_f32_zero(g, hid, nt * h)?;
            }
            if !run(sk::DOWN) {
            } else if grouped {
                // Right after the gate/up, except for a rank's memset of its partial sum.
                g.moe_down_grp_any(&dn, grp, e, nslots, aq, ad, p(&ws.dpart), !(tp && !lead))?;
                g.moe_combine_grp(p(&ws.dpart), wts, k, dn.rows, hid, h, nt)?;
            } else {
                // The next norm: the next layer's, or the output norm after a last stage's last layer.
                let next_w = match self.layers.get(li + 1) {
                    Some(nl) => Some(nl.attn_norm),
                    None if self.part.last_stage => Some(self.out_norm),
                    None => None,
                };
                // One token whose next layer's q/k/v takes the x8 hand-over (fast::norm_x8), and a
                // streamed down that writes it (else the last-block norm, not the register down).
                let x8 = nt == 1 && super::fast::norm_x8() && self.layers.get(li + 1).is_some_and(|nl| Gpu::x8_fits(&[(&nl.wq, 0, 0), (&nl.wk, 0, 0), (&nl.wv, 0, 0)], h)) && g.down_takes_x8(&dn, k)?;
                let ss8 = if x8 { p(&ws.ss8) } else { 0 };
                let next = next_w.filter(|_| fuse_down).map(|w| super::stream::NextNorm { weight: w, eps: c.rms_eps, q: xq, d: xd, cnt: g.ptr(&ws.ncnt), trig_late: super::fast::down_trig_late(), ss8 });
                // The streamed down's plan refuses what it cannot take (K-quants among them).
                normed = match next {
                    Some(n) => g.try_down_stream_norm(&dn, ids, wts, k, nt, aq, ad, hid, h, Some(&n))?,
                    None => false,
                };
                normed_x8 = normed && x8;
                if !normed {
                    g.moe_down_q8_any(&dn, ids, wts, k, aq, ad, hid, h, nt)?;
                }
            }
            if tp {
                all_reduce(hid, nt * h)?;
            }
        }
        if self.part.last_stage {
            if !normed {
                g.norm_q8(hid, h, self.out_norm, h, c.rms_eps, 0, 0, xq, xd, nt)?;
            }
            g.matvec_q8_any(&[(&self.head, p(&ws.logits[par]), c.vocab_size)], xq, xd, h, nt, false)?;
        }
        Ok(())
    }

    /// The fast path of [`CudaModel::forward`]: one metadata upload, then the step's graph.
    /// `feed`: device-fed tokens ([`CudaModel::set_device_feed`]).
    fn forward_fast(&mut self, batch: &ForwardBatch, feed: &[(usize, usize)]) -> Result<Option<StepLogits<'_>>, CudaError> {
        let nt = batch.n_tokens();
        let ps = self.page_size;
        let t = MAX_FAST_TOKENS;
        let mut meta = vec![0i32; 5 * t];
        let mut pts: Vec<i32> = Vec::new();
        let mut rows = Vec::new();
        let mut out_idx = Vec::new();
        let mut ti = 0;
        for (si, s) in batch.seqs.iter().enumerate() {
            meta[4 * t + si] = pts.len() as i32;
            let needed = (s.cached_len + s.tokens.len()).div_ceil(ps);
            pts.extend(s.page_table[..needed].iter().map(|&x| x as i32));
            for i in s.wanted() {
                rows.push(LogitsRow { seq: si, position: s.cached_len + i });
                out_idx.push(ti + i);
            }
            for (i, &tok) in s.tokens.iter().enumerate() {
                let pp = s.cached_len + i;
                meta[ti] = match feed.iter().find(|f| f.0 == si) {
                    // The previous step's draw for this row, read on the device (dq_rows).
                    Some(&(_, j)) if s.tokens.len() == 1 && j < t => -1 - j as i32,
                    Some(_) => return Err(CudaError::Shape(format!("device-fed sequence {si}: one token and a row below {t}"))),
                    None => tok as i32,
                };
                meta[t + ti] = pp as i32;
                meta[2 * t + ti] = si as i32;
                meta[3 * t + ti] = (s.page_table[pp / ps] as usize * ps + pp % ps) as i32;
                ti += 1;
            }
        }
        if pts.len() > self.fast.as_ref().unwrap().pts_cap {
            let cap = pts.len().next_power_of_two();
            // An overlapped step before this one may still run its graph, on this buffer.
            self.gpu.sync()?;
            let ws = self.fast.as_mut().unwrap();
            ws.graphs.clear();
            ws.meta = self.gpu.zeros(5 * t + cap)?;
            ws.pts_cap = cap;
        }
        meta.extend_from_slice(&pts);
        {
            let ws = self.fast.as_mut().unwrap();
            let mut dst = ws.meta.slice_mut(0..meta.len());
            self.gpu.stream.memcpy_htod(&meta, &mut dst)?;
        }
        if !self.part.first_stage {
            let h = self.cfg.hidden;
            let mut dst = self.fast.as_mut().unwrap().hidden.slice_mut(0..nt * h);
            let comm = self.comm.as_ref().ok_or_else(|| CudaError::Shape("pipeline stage has no NCCL communicator (JOIN first)".into()))?;
            comm.recv(&mut dst, self.part.pp_rank - 1)?;
        }
        let max_ctx = batch.seqs.iter().map(|s| s.cached_len + s.tokens.len()).max().unwrap_or(0);
        let short = super::fast::attn_short() && max_ctx <= super::fast::ATTN_SHORT_MAX_CTX;
        self.fast.as_mut().unwrap().last_short = short;
        // Steps alternate logits buffers (the previous step's rows may not be read back yet).
        let par = 1 - self.fast.as_ref().unwrap().par;
        self.fast.as_mut().unwrap().par = par;
        let key = (nt, short, par);
        let have_graph = self.fast.as_ref().unwrap().graphs.contains_key(&key);
        if self.opts.graphs && have_graph {
            self.fast.as_ref().unwrap().graphs[&key].0.launch()?;
        } else {
            self.enqueue_fast(nt, short, par)?;
            if self.opts.graphs {
                self.gpu.sync()?;
                use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
                self.gpu.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
                let r = self.enqueue_fast(nt, short, par);
                let graph = self.gpu.stream.end_capture(CUgraphInstantiate_flags(0))?;
                r?;
                if let Some(gr) = graph {
                    self.fast.as_mut().unwrap().graphs.insert(key, super::fast::Graph(gr));
                }
            }
        }
        if !self.part.last_stage {
            let src = self.fast.as_ref().unwrap().hidden.slice(0..nt * self.cfg.hidden);
            self.stage_send(&src)?;
            self.gpu.sync()?;
            return Ok(None);
        }
        // The rows stay in the workspace's logits buffer (row = flat token index): the caller
        // downloads them (`StepLogits::into_host`, forward_stage) or reduces them in place; both
        // sync. Without tensor parallelism this rank is the head and reduces them next on this
        // stream, so (unless MINIMAX_FAST_SYNC=1) the sampling kernels queue behind the graph
        // without a host round trip between them.
        // A step that wants no rows (a prefill chunk) is never reduced: it waits here, so its
        // errors surface in it.
        if super::fast::fast_sync() || self.part.tp_world > 1 || rows.is_empty() {
            self.gpu.sync()?;
        }
        Ok(Some(StepLogits::device(&*self, rows, out_idx, par)))
    }

    /// Runs one fast step of `nt` tokens from whatever metadata is in the workspace, without
    /// reading logits back (benchmark: kernel time of a step; graphs as configured).
    pub fn replay_fast_step(&mut self, nt: usize) -> Result<(), CudaError> {
        let ws = self.fast.as_ref().ok_or_else(|| CudaError::Shape("fast path off".into()))?;
        let (short, par) = (ws.last_short, ws.par);
        match ws.graphs.get(&(nt, short, par)) {
            Some(gr) if self.opts.graphs => gr.0.launch()?,
            _ => self.enqueue_fast(nt, short, par)?,
        }
        Ok(())
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The device and its kernels.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// How the weight upload went.
    pub fn load_stats(&self) -> LoadStats {
        self.stats
    }

    /// Checks a batch against this model's cache before anything is touched.
    pub fn validate(&self, batch: &ForwardBatch) -> Result<(), CudaError> {
        batch.validate(self.page_size, self.n_pages, self.cfg.vocab_size, self.cfg.context_length)?;
        Ok(())
    }

    /// This rank's share of the model.
    pub fn partition(&self) -> &Partition {
        &self.part
    }

    /// Builds this rank's NCCL communicator from rank 0's unique id (JOIN); replaces any
    /// previous one. A world of one needs none.
    pub fn join_nccl(&mut self, rank: usize, world: usize, id: &[u8]) -> Result<(), CudaError> {
        if self.part.pp_world > 1 {
            // Pipeline: the communicator's rank is the stage (activations go stage to stage).
            if world != self.part.pp_world || rank != self.part.pp_rank {
                return Err(CudaError::Shape(format!(
                    "JOIN as rank {rank} of {world}, but the weights loaded are pipeline stage {} of {}",
                    self.part.pp_rank, self.part.pp_world
                )));
            }
        } else if world != self.part.tp_world || rank != self.part.tp_rank {
            return Err(CudaError::Shape(format!(
                "JOIN as rank {rank} of {world}, but the weights loaded are rank {} of {}",
                self.part.tp_rank, self.part.tp_world
            )));
        }
        // Captured fast-step graphs hold the old communicator's collectives: capture again.
        self.clear_graphs();
        self.comm = None;
        let tensor = self.part.pp_world == 1;
        self.comm = Some(NcclComm::join(&self.gpu.ctx, &self.gpu.stream, rank, world, id, tensor)?);
        Ok(())
    }

    /// Forgets the communicator (the world broke; a re-JOIN builds a new one).
    pub fn leave_nccl(&mut self) {
        self.clear_graphs();
        self.comm = None;
    }

    /// A handle that aborts this rank's communicator from another thread (the server's
    /// watcher, when a peer died while a collective waits on it); None before JOIN.
    pub fn nccl_abort_handle(&self) -> Option<super::nccl::NcclAbort> {
        self.comm.as_ref().map(|c| c.abort_handle())
    }

    fn reduce(&self, buf: &mut CudaSlice<f32>) -> Result<(), CudaError> {
        match &self.comm {
            Some(c) => c.all_reduce_sum(buf),
            None => Err(CudaError::Shape("tensor-parallel rank has no NCCL communicator (JOIN first)".into())),
        }
    }

    /// Full-width q/k RMSNorm of this rank's slice (exact path): per-token sums of squares of
    /// the local q and k (f64, rounded to f32 once), summed across ranks with NCCL, then every
    /// rank scales its slice (`kernels/tp.cu`; the CPU backend's arithmetic, all on the device).
    fn tp_qk_norm(&self, l: &Layer, q: &mut CudaSlice<f32>, k: &mut CudaSlice<f32>, nt: usize) -> Result<(), CudaError> {
        let c = &self.cfg;
        let g = &self.gpu;
        let (qw, kw) = (self.heads * c.head_dim, self.kv_heads * c.head_dim);
        let mut ss = g.zeros::<f32>(2 * nt)?;
        let (qp, kp, sp) = (g.ptr(q), g.ptr(k), g.ptr(&ss));
        g.launch("tp_qk_sumsq", (nt as u32, 2, 1), 256, 0, &[Arg::P(qp), Arg::L(qw as i64), Arg::P(kp), Arg::L(kw as i64), Arg::I(qw as i32), Arg::I(kw as i32), Arg::P(sp)])?;
        self.reduce(&mut ss)?;
        g.launch(
            "tp_qk_scale",
            (nt as u32, 2, 1),
            256,
            0,
            &[
                Arg::P(qp),
                Arg::L(qw as i64),
                Arg::P(l.q_norm),
                Arg::P(kp),
                Arg::L(kw as i64),
                Arg::P(l.k_norm),
                Arg::I(qw as i32),
                Arg::I(kw as i32),
                Arg::P(sp),
                Arg::I((c.n_heads * c.head_dim) as i32),
                Arg::I((c.n_kv_heads * c.head_dim) as i32),
                Arg::F(c.rms_eps),
            ],
        )?;
        Ok(())
    }

    /// Benchmark switch: enqueue (true) or skip (false: kernel time alone, wrong results) the
    /// fast path's tensor-parallel all-reduces; drops the captured graphs.
    pub fn set_tp_collectives(&mut self, on: bool) {
        self.tp_collectives = on;
        if let Some(ws) = self.fast.as_mut() {
            ws.graphs.clear();
        }
    }

    /// Collectives one fast step enqueues (per step, whatever its size): 3 per layer under
    /// tensor parallelism (q/k sums of squares, o-proj, MoE down), none otherwise.
    pub fn tp_collectives_per_step(&self) -> usize {
        if self.part.tp_world > 1 { 3 * self.layers.len() } else { 0 }
    }

    /// Embeds the batch's tokens, runs every layer (writing their K/V into the cache) and
    /// returns the logits the batch asks for. A pipeline stage before the last has none to
    /// return: use [`CudaModel::forward_stage`] there.
    pub fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOutput, CudaError> {
        self.forward_stage(batch)?
            .ok_or_else(|| CudaError::Shape(format!("pipeline stage {} of {} computes no logits (forward_stage)", self.part.pp_rank, self.part.pp_world)))
    }

    /// This rank's part of one step. The first pipeline stage embeds the tokens, later stages
    /// receive the previous stage's hidden states (`n_tokens x hidden` f32, NCCL on the
    /// model's stream, device to device); every stage runs its layer range (writing their
    /// K/V); the last stage returns the logits asked for, earlier stages send their hidden
    /// states on and return `None`. Every stage must be given the same batch, concurrently
    /// (separate processes or one thread per GPU). A whole model or a tensor-parallel rank
    /// always returns `Some`.
    pub fn forward_stage(&mut self, batch: &ForwardBatch) -> Result<Option<ForwardOutput>, CudaError> {
        self.forward_stage_lazy(batch)?.map(StepLogits::into_host).transpose()
    }

    /// [`CudaModel::forward_stage`], except that the fast path leaves the logits rows on the
    /// device (reduce them there with [`StepLogits::reduce`], which downloads only rows the
    /// host must reduce itself); the exact path returns them on the host.
    pub fn forward_stage_lazy(&mut self, batch: &ForwardBatch) -> Result<Option<StepLogits<'_>>, CudaError> {
        let feed = std::mem::take(&mut self.feed);
        self.validate(batch)?;
        let tp = self.part.tp_world > 1;
        if tp && self.comm.is_none() {
            return Err(CudaError::Shape("tensor-parallel rank has no NCCL communicator (JOIN first)".into()));
        }
        let pp = self.part.pp_world > 1;
        if pp && (tp || self.comm.is_none()) {
            return Err(CudaError::Shape(if tp {
                "pipeline and tensor parallelism together are not supported on CUDA".into()
            } else {
                format!("pipeline stage {} has no NCCL communicator (JOIN first)", self.part.pp_rank)
            }));
        }
        if self.fast_eligible(batch.n_tokens()) {
            return self.forward_fast(batch, &feed);
        }
        if !feed.is_empty() {
            return Err(CudaError::Shape("device-fed tokens need the fast path".into()));
        }
        let c = &self.cfg;
        let g = &self.gpu;
        let nt = batch.n_tokens();
        let (h, ps) = (c.hidden, self.page_size);
        // Host-side metadata of the flat batch.
        let (mut tokens, mut pos, mut seq, mut slots) = (Vec::with_capacity(nt), Vec::with_capacity(nt), Vec::with_capacity(nt), Vec::with_capacity(nt));
        let (mut pt_off, mut pts) = (Vec::new(), Vec::new());
        let (mut rows, mut out_idx) = (Vec::new(), Vec::new());
        let (mut seq_start, mut max_seq_tokens) = (Vec::with_capacity(batch.seqs.len() + 1), 0);
        for (si, s) in batch.seqs.iter().enumerate() {
            seq_start.push(tokens.len() as i32);
            max_seq_tokens = max_seq_tokens.max(s.tokens.len());
            pt_off.push(pts.len() as i32);
            let needed = (s.cached_len + s.tokens.len()).div_ceil(ps);
            pts.extend_from_slice(&s.page_table[..needed]);
            for i in s.wanted() {
                rows.push(LogitsRow { seq: si, position: s.cached_len + i });
                out_idx.push((tokens.len() + i) as i32);
            }
            for (i, &t) in s.tokens.iter().enumerate() {
                let p = s.cached_len + i;
                tokens.push(t as i32);
                pos.push(p as i32);
                seq.push(si as i32);
                slots.push((s.page_table[p / ps] as usize * ps + p % ps) as i32);
            }
        }
        let st = Step {
            tokens: g.upload(&tokens)?,
            pos: g.upload(&pos)?,
            seq: g.upload(&seq)?,
            slots: g.upload(&slots)?,
            pt_off: g.upload(&pt_off)?,
            pts: g.upload(&pts)?,
            out_idx: g.upload(if out_idx.is_empty() { &[0] } else { &out_idx })?,
            seq_start: g.upload(&{
                seq_start.push(nt as i32);
                seq_start
            })?,
        };
        let (qw, kw, vw) = (self.heads * c.head_dim, self.kv_heads * c.head_dim, self.kv_heads * c.v_head_dim);
        let ow = self.heads * c.v_head_dim;
        let (k, ff, e) = (c.n_experts_used, self.ff, c.n_experts);
        let mut hidden = g.zeros::<f32>(nt * h)?;
        let normed = g.zeros::<f32>(nt * h)?;
        let mut q = g.zeros::<f32>(nt * qw)?;
        let mut kb = g.zeros::<f32>(nt * kw)?;
        // Tensor parallelism: partial projections are reduced here, then added into hidden
        // with moe_combine (weights of one).
        let mut partial = g.zeros::<f32>(if tp { nt * h } else { 1 })?;
        let ones = g.upload(&vec![1f32; nt])?;
        let vb = g.zeros::<f32>(nt * vw)?;
        let att = g.zeros::<f32>(nt * ow)?;
        let rl = g.zeros::<f32>(nt * e)?;
        let ids = g.zeros::<i32>(nt * k)?;
        let wts = g.zeros::<f32>(nt * k)?;
        let gb = g.zeros::<f32>(nt * k * ff)?;
        let ub = g.zeros::<f32>(nt * k * ff)?;
        let db = g.zeros::<f32>(nt * k * h)?;
        let p = |s: &CudaSlice<f32>| g.ptr(s);
        let (hid, nrm) = (p(&hidden), p(&normed));

        if self.part.first_stage {
            g.dequant_rows(&self.embd, g.ptr(&st.tokens), nt, hid, h)?;
        } else {
            self.stage_recv(&mut hidden)?;
        }
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        for (li, l) in self.layers.iter().enumerate() {
            g.rms_norm(hid, h, l.attn_norm, nrm, h, nt, h, c.rms_eps)?;
            // The bf16 copies where the quantized weights would take cuBLAS (same values).
            let dense = self.dense_bf16.get(li).filter(|_| DENSE_COPIES.get());
            match dense {
                Some(d) if g.shared_blas_takes(&[&l.wq, &l.wk, &l.wv], nrm, h, nt) => g.blas_shared(&[(&d[0], p(&q), qw), (&d[1], p(&kb), kw), (&d[2], p(&vb), vw)], nrm, h, nt)?,
                _ => g.matvec_shared(&[(&l.wq, p(&q), qw), (&l.wk, p(&kb), kw), (&l.wv, p(&vb), vw)], nrm, h, nt)?,
            }
            let o_proj = |y: u64, acc: bool| -> Result<(), CudaError> {
                match dense {
                    Some(d) if g.dense_blas_takes(&l.wo, p(&att), ow, nt) => g.matmul_blas(&d[3], p(&att), ow, y, h, nt, acc),
                    _ => g.matvec(&l.wo, p(&att), ow, y, h, nt, acc),
                }
            };
            if tp {
                self.tp_qk_norm(l, &mut q, &mut kb, nt)?;
            } else {
                g.rms_norm(p(&q), qw, l.q_norm, p(&q), qw, nt, qw, c.rms_eps)?;
                g.rms_norm(p(&kb), kw, l.k_norm, p(&kb), kw, nt, kw, c.rms_eps)?;
            }
            g.rope(p(&q), qw, nt, self.heads, c.head_dim, c.rotary_dim, g.ptr(&st.pos), c.rope_theta)?;
            g.rope(p(&kb), kw, nt, self.kv_heads, c.head_dim, c.rotary_dim, g.ptr(&st.pos), c.rope_theta)?;
            let (kc, vc) = (g.ptr(&self.kc[li]), g.ptr(&self.vc[li]));
            g.kv_store(self.kv_dtype, p(&kb), p(&vb), kw, vw, g.ptr(&st.slots), kc, vc, nt)?;
            g.attention(
                self.kv_dtype,
                &AttnArgs {
                    q: p(&q),
                    qs: qw,
                    kc,
                    vc,
                    pos: g.ptr(&st.pos),
                    seq: g.ptr(&st.seq),
                    pt_off: g.ptr(&st.pt_off),
                    page_tables: g.ptr(&st.pts),
                    page_size: ps,
                    heads: self.heads,
                    kv_heads: self.kv_heads,
                    hd: c.head_dim,
                    vd: c.v_head_dim,
                    scale,
                    out: p(&att),
                    os: ow,
                    nt,
                    seq_start: g.ptr(&st.seq_start),
                    n_seqs: batch.seqs.len(),
                    max_seq_tokens,
                },
            )?;
            if tp {
                o_proj(p(&partial), false)?;
                self.reduce(&mut partial)?;
                g.moe_combine(hid, p(&partial), p(&ones), 1, h, nt)?;
            } else {
                o_proj(hid, true)?;
            }

            g.rms_norm(hid, h, l.ffn_norm, nrm, h, nt, h, c.rms_eps)?;
            g.matvec(&l.router, nrm, h, p(&rl), e, nt, false)?;
            g.route(p(&rl), l.bias, e, k, c.gating, g.ptr(&ids), p(&wts), nt)?;
            let idp = g.ptr(&ids);
            // Many tokens: grouped expert GEMMs on tensor cores (one grouping for all three).
            g.moe_experts((&l.gate, &l.up, &l.down), idp, nt * k, k, nrm, h, (p(&gb), p(&ub), ff), (p(&db), h))?;
            if tp {
                g.stream.memset_zeros(&mut partial)?;
                g.moe_combine(p(&partial), p(&db), p(&wts), k, h, nt)?;
                self.reduce(&mut partial)?;
                g.moe_combine(hid, p(&partial), p(&ones), 1, h, nt)?;
            } else {
                g.moe_combine(hid, p(&db), p(&wts), k, h, nt)?;
            }
        }

        if !self.part.last_stage {
            self.stage_send(&hidden)?;
            g.sync()?;
            return Ok(None);
        }
        let v = c.vocab_size;
        let nr = rows.len();
        let mut logits = Vec::new();
        if nr > 0 {
            let sel = g.zeros::<f32>(nr * h)?;
            let lg = g.zeros::<f32>(nr * v)?;
            g.gather_rows(hid, h, g.ptr(&st.out_idx), p(&sel), h, h, nr)?;
            g.rms_norm(p(&sel), h, self.out_norm, p(&sel), h, nr, h, c.rms_eps)?;
            // Several rows (a step of several prompts): the GEMM reads the 650 MB head once per
            // token tile instead of once per 8 rows (32 rows at M2.7 size: 20 ms -> ~1 ms).
            if nr > 1 && g.gemm_unfit(&self.head, p(&sel), h).is_none() {
                g.matmul(&self.head, p(&sel), h, p(&lg), v, nr, false)?;
            } else {
                g.matvec(&self.head, p(&sel), h, p(&lg), v, nr, false)?;
            }
            logits = g.download(&lg)?;
            logits.truncate(nr * v);
        }
        g.sync()?;
        Ok(Some(StepLogits::host(&*self, ForwardOutput { rows, logits, vocab_size: v })))
    }

    /// Pipeline: receives the previous stage's hidden states into `buf` (on the stream).
    fn stage_recv<R: cudarc::driver::DevicePtrMut<f32>>(&self, buf: &mut R) -> Result<(), CudaError> {
        let comm = self.comm.as_ref().ok_or_else(|| CudaError::Shape("pipeline stage has no NCCL communicator (JOIN first)".into()))?;
        comm.recv(buf, self.part.pp_rank - 1)
    }

    /// Pipeline: sends this stage's hidden states to the next stage (on the stream).
    fn stage_send<S: cudarc::driver::DevicePtr<f32>>(&self, buf: &S) -> Result<(), CudaError> {
        let comm = self.comm.as_ref().ok_or_else(|| CudaError::Shape("pipeline stage has no NCCL communicator (JOIN first)".into()))?;
        comm.send(buf, self.part.pp_rank + 1)
    }
}

/// Zeroes `n` f32 at device address `p` on the model's stream (capturable memset node).
fn memset_f32_zero(g: &Gpu, p: u64, n: usize) -> Result<(), CudaError> {
    g.ctx.bind_to_thread()?;
    unsafe { cudarc::driver::sys::cuMemsetD32Async(p, 0, n, g.stream.cu_stream()) }.result()?;
    Ok(())
}

/// The placeholder for a matrix this rank does not hold (the embedding on a pipeline stage
/// after the first, lm_head before the last): null pointer, no rows, never launched on.
pub(crate) fn absent_mat() -> DevMat {
    DevMat { ptr: 0, ty: GgmlType::F32, rows: 0, cols: 0, row_bytes: 0, n_experts: 0, expert_stride: 0 }
}

/// Checks that `part` is a share this backend can run: layers inside the model, and either
/// tensor parallelism (every layer) or pipeline stages (no mix of the two yet).
pub(crate) fn check_partition(cfg: &ModelConfig, part: &Partition) -> Result<(), CudaError> {
    let l = &part.layers;
    if l.start >= l.end || l.end > cfg.n_layers {
        return Err(CudaError::Shape(format!("layers {l:?} of a {}-layer model", cfg.n_layers)));
    }
    let whole_range = *l == (0..cfg.n_layers);
    if part.first_stage != (part.pp_rank == 0) || part.last_stage != (part.pp_rank + 1 == part.pp_world) || part.pp_rank >= part.pp_world {
        return Err(CudaError::Shape(format!("inconsistent pipeline stage {} of {} (first {}, last {})", part.pp_rank, part.pp_world, part.first_stage, part.last_stage)));
    }
    if part.pp_world == 1 && !whole_range {
        return Err(CudaError::Shape(format!("layers {l:?} without pipeline stages")));
    }
    if part.pp_world > 1 && part.tp_world > 1 {
        return Err(CudaError::Shape("pipeline and tensor parallelism together are not supported on CUDA".into()));
    }
    Ok(())
}

/// Whether every weight type of `model` has a CUDA kernel (all the CPU reference supports).
pub fn supported(ty: GgmlType) -> bool {
    ty.is_supported()
}
