//! `CudaModel`: the whole MiniMax-M2 forward on one GPU, behind the same batch contract as
//! the CPU reference (`forward(&ForwardBatch) -> ForwardOutput`, same validation). Weights
//! are copied from the memory-mapped GGUF to device memory in their quantized form;
//! activations are f32; the paged KV cache is f16 (or bf16, or f32 for exact checks).

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaSlice;
use minimax_shared::forward::{ForwardBatch, ForwardOutput, LogitsRow, LogitsWanted};
use minimax_shared::gguf::GgufModel;
use minimax_shared::model::{ModelConfig, names};
use minimax_shared::quant::{self, GgmlType};

use super::error::CudaError;
use super::gpu::{AttnArgs, DevMat, Gpu, KvDtype};
use crate::cpu::KvSpec;

/// Options for [`CudaModel::load`].
#[derive(Clone, Copy, Debug, Default)]
pub struct CudaOptions {
    /// CUDA device ordinal.
    pub device: usize,
    pub kv_dtype: KvDtype,
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
}

/// Copies tensors to the device, keeping the buffers and logging progress.
struct Uploader<'a> {
    gpu: &'a Gpu,
    model: &'a GgufModel,
    bufs: Vec<CudaSlice<u8>>,
    stats: LoadStats,
    total: usize,
    t0: Instant,
    next_log: usize,
}

impl Uploader<'_> {
    fn put(&mut self, bytes: &[u8]) -> Result<u64, CudaError> {
        let b = self.gpu.upload(bytes)?;
        let p = self.gpu.ptr(&b);
        self.bufs.push(b);
        self.stats.tensors += 1;
        self.stats.bytes += bytes.len();
        if self.stats.bytes >= self.next_log {
            let s = self.t0.elapsed().as_secs_f64().max(1e-9);
            let rate = self.stats.bytes as f64 / s;
            let eta = (self.total.saturating_sub(self.stats.bytes)) as f64 / rate.max(1.0);
            tracing::info!(
                "weights: {:.2}/{:.2} GB, {:.2} GB/s, ETA {:.0} s",
                self.stats.bytes as f64 / 1e9,
                self.total as f64 / 1e9,
                rate / 1e9,
                eta
            );
            self.next_log = self.stats.bytes + (self.total / 20).max(1 << 30);
        }
        Ok(p)
    }

    /// A 2-D (or 3-D expert) matrix, uploaded in its quantized form.
    fn mat(&mut self, name: &str) -> Result<DevMat, CudaError> {
        let t = self.model.tensor(name).ok_or_else(|| CudaError::MissingTensor(name.to_string()))?;
        let info = t.info;
        if !info.ty.is_supported() {
            return Err(CudaError::Unsupported { ty: info.ty, what: name.to_string() });
        }
        let cols = info.row_len();
        let row_bytes = quant::row_bytes(info.ty, cols)?;
        let (rows, n_experts) = match info.dims.len() {
            2 => (info.dims[1] as usize, 0),
            3 => (info.dims[1] as usize, info.dims[2] as usize),
            _ => return Err(CudaError::Shape(format!("{name}: {} dims", info.dims.len()))),
        };
        let ptr = self.put(t.data)?;
        Ok(DevMat { ptr, ty: info.ty, rows, cols, row_bytes, n_experts, expert_stride: rows * row_bytes })
    }

    /// A 1-D tensor, converted to f32 on the host.
    fn vec_f32(&mut self, name: &str) -> Result<u64, CudaError> {
        let t = self.model.tensor(name).ok_or_else(|| CudaError::MissingTensor(name.to_string()))?;
        let v = quant::dequantize_to_vec(t.info.ty, t.data, t.info.n_elems() as usize)?;
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.put(&bytes)
    }
}

/// Per-step device buffers.
struct Step {
    tokens: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    seq: CudaSlice<i32>,
    slots: CudaSlice<i32>,
    pt_off: CudaSlice<i32>,
    pts: CudaSlice<u32>,
    out_idx: CudaSlice<i32>,
}

impl CudaModel {
    /// Loads the whole model onto one GPU and allocates a zeroed KV cache.
    pub fn load(model: Arc<GgufModel>, kv: KvSpec, opts: CudaOptions) -> Result<Self, CudaError> {
        let cfg = ModelConfig::from_gguf(&model)?;
        let gpu = Gpu::new(opts.device)?;
        let mut names_needed = vec![names::TOKEN_EMBD.to_string(), names::OUTPUT_NORM.to_string()];
        if !cfg.tied_embeddings {
            names_needed.push(names::OUTPUT.to_string());
        }
        let total: usize = model.tensors().map(|t| t.n_bytes as usize).sum();
        let mut up = Uploader { gpu: &gpu, model: &model, bufs: Vec::new(), stats: LoadStats::default(), total, t0: Instant::now(), next_log: 0 };
        let embd = up.mat(names::TOKEN_EMBD)?;
        let out_norm = up.vec_f32(names::OUTPUT_NORM)?;
        let head = if cfg.tied_embeddings { embd } else { up.mat(names::OUTPUT)? };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let n = |s: &str| names::block(l, s);
            layers.push(Layer {
                attn_norm: up.vec_f32(&n(names::ATTN_NORM))?,
                wq: up.mat(&n(names::ATTN_Q))?,
                wk: up.mat(&n(names::ATTN_K))?,
                wv: up.mat(&n(names::ATTN_V))?,
                wo: up.mat(&n(names::ATTN_OUTPUT))?,
                q_norm: up.vec_f32(&n(names::ATTN_Q_NORM))?,
                k_norm: up.vec_f32(&n(names::ATTN_K_NORM))?,
                ffn_norm: up.vec_f32(&n(names::FFN_NORM))?,
                router: up.mat(&n(names::FFN_GATE_INP))?,
                bias: up.vec_f32(&n(names::EXP_PROBS_B))?,
                gate: up.mat(&n(names::FFN_GATE_EXPS))?,
                up: up.mat(&n(names::FFN_UP_EXPS))?,
                down: up.mat(&n(names::FFN_DOWN_EXPS))?,
            });
        }
        gpu.sync()?;
        let mut stats = up.stats;
        stats.seconds = up.t0.elapsed().as_secs_f64();
        let bufs = std::mem::take(&mut up.bufs);
        drop(up);
        tracing::info!(
            "weights on {}: {} tensors, {:.3} GB in {:.2} s ({:.2} GB/s)",
            gpu.name,
            stats.tensors,
            stats.bytes as f64 / 1e9,
            stats.seconds,
            stats.gb_per_s()
        );
        let slots = kv.page_size * kv.n_pages;
        let mut kc = Vec::new();
        let mut vc = Vec::new();
        for _ in 0..cfg.n_layers {
            let eb = opts.kv_dtype.bytes();
            kc.push(gpu.zeros::<u8>(slots * cfg.n_kv_heads * cfg.head_dim * eb)?);
            vc.push(gpu.zeros::<u8>(slots * cfg.n_kv_heads * cfg.v_head_dim * eb)?);
        }
        Ok(Self {
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
        })
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

    /// Embeds the batch's tokens, runs every layer (writing their K/V into the cache) and
    /// returns the logits the batch asks for.
    pub fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOutput, CudaError> {
        self.validate(batch)?;
        let c = &self.cfg;
        let g = &self.gpu;
        let nt = batch.n_tokens();
        let (h, ps) = (c.hidden, self.page_size);
        // Host-side metadata of the flat batch.
        let (mut tokens, mut pos, mut seq, mut slots) = (Vec::with_capacity(nt), Vec::with_capacity(nt), Vec::with_capacity(nt), Vec::with_capacity(nt));
        let (mut pt_off, mut pts) = (Vec::new(), Vec::new());
        let (mut rows, mut out_idx) = (Vec::new(), Vec::new());
        for (si, s) in batch.seqs.iter().enumerate() {
            pt_off.push(pts.len() as i32);
            let needed = (s.cached_len + s.tokens.len()).div_ceil(ps);
            pts.extend_from_slice(&s.page_table[..needed]);
            let n = s.tokens.len();
            let wanted = match s.logits {
                LogitsWanted::None => 0..0,
                LogitsWanted::Last => n - 1..n,
                LogitsWanted::All => 0..n,
            };
            for i in wanted {
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
        };
        let (qw, kw, vw) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.v_head_dim);
        let ow = c.n_heads * c.v_head_dim;
        let (k, ff, e) = (c.n_experts_used, c.expert_ff, c.n_experts);
        let hidden = g.zeros::<f32>(nt * h)?;
        let normed = g.zeros::<f32>(nt * h)?;
        let q = g.zeros::<f32>(nt * qw)?;
        let kb = g.zeros::<f32>(nt * kw)?;
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

        g.dequant_rows(&self.embd, g.ptr(&st.tokens), nt, hid, h)?;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        for (li, l) in self.layers.iter().enumerate() {
            g.rms_norm(hid, h, l.attn_norm, nrm, h, nt, h, c.rms_eps)?;
            g.matvec(&l.wq, nrm, h, p(&q), qw, nt, false)?;
            g.matvec(&l.wk, nrm, h, p(&kb), kw, nt, false)?;
            g.matvec(&l.wv, nrm, h, p(&vb), vw, nt, false)?;
            g.rms_norm(p(&q), qw, l.q_norm, p(&q), qw, nt, qw, c.rms_eps)?;
            g.rms_norm(p(&kb), kw, l.k_norm, p(&kb), kw, nt, kw, c.rms_eps)?;
            g.rope(p(&q), qw, nt, c.n_heads, c.head_dim, c.rotary_dim, g.ptr(&st.pos), c.rope_theta)?;
            g.rope(p(&kb), kw, nt, c.n_kv_heads, c.head_dim, c.rotary_dim, g.ptr(&st.pos), c.rope_theta)?;
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
                    heads: c.n_heads,
                    kv_heads: c.n_kv_heads,
                    hd: c.head_dim,
                    vd: c.v_head_dim,
                    scale,
                    out: p(&att),
                    os: ow,
                    nt,
                },
            )?;
            g.matvec(&l.wo, p(&att), ow, hid, h, nt, true)?;

            g.rms_norm(hid, h, l.ffn_norm, nrm, h, nt, h, c.rms_eps)?;
            g.matvec(&l.router, nrm, h, p(&rl), e, nt, false)?;
            g.route(p(&rl), l.bias, e, k, c.gating, g.ptr(&ids), p(&wts), nt)?;
            let idp = g.ptr(&ids);
            g.matvec_experts(&l.gate, idp, nrm, h, k, p(&gb), ff, nt * k)?;
            g.matvec_experts(&l.up, idp, nrm, h, k, p(&ub), ff, nt * k)?;
            g.silu_mul(p(&gb), p(&ub), p(&gb), nt * k * ff)?;
            g.matvec_experts(&l.down, idp, p(&gb), ff, 1, p(&db), h, nt * k)?;
            g.moe_combine(hid, p(&db), p(&wts), k, h, nt)?;
        }

        let v = c.vocab_size;
        let nr = rows.len();
        let mut logits = Vec::new();
        if nr > 0 {
            let sel = g.zeros::<f32>(nr * h)?;
            let lg = g.zeros::<f32>(nr * v)?;
            g.gather_rows(hid, h, g.ptr(&st.out_idx), p(&sel), h, h, nr)?;
            g.rms_norm(p(&sel), h, self.out_norm, p(&sel), h, nr, h, c.rms_eps)?;
            g.matvec(&self.head, p(&sel), h, p(&lg), v, nr, false)?;
            logits = g.download(&lg)?;
            logits.truncate(nr * v);
        }
        g.sync()?;
        Ok(ForwardOutput { rows, logits, vocab_size: v })
    }
}

/// Whether every weight type of `model` has a CUDA kernel (all the CPU reference supports).
pub fn supported(ty: GgmlType) -> bool {
    ty.is_supported()
}
