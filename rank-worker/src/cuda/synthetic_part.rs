//! Synthetic weights for any [`Partition`] (a child module of `model.rs`, so it builds the
//! model's private layer records directly). Every tensor of the whole model is filled on the
//! device with the same seed it gets in a one-GPU synthetic model; a tensor-parallel rank then
//! keeps exactly its slice (same rows / columns as `CudaModel::load_part` takes from a GGUF), so
//! a TP world and one GPU built with the same seed hold the same model. Pipeline stages keep
//! their layer range only (embedding on the first stage, output norm and head on the last).

use std::ops::Range;
use std::time::Instant;

use cudarc::driver::CudaSlice;
use cudarc::driver::sys;
use minimax_shared::model::names;
use minimax_shared::model::synthetic::SyntheticSpec;
use minimax_shared::quant;

use super::super::error::CudaError;
use super::super::gpu::{DevMat, Gpu};
use super::{CudaModel, CudaOptions, Layer, LoadStats};
use crate::cpu::KvSpec;
use crate::partition::Partition;

/// Which part of a whole tensor one rank keeps.
#[derive(Clone, Debug, PartialEq)]
enum Slice {
    All,
    /// Rows (per expert for 3-D tensors).
    Rows(Range<usize>),
    /// Columns (elements of every row; a 1-D tensor is one row).
    Cols(Range<usize>),
}

/// The slice of tensor `short` (name without `blk.N.`) that `part` keeps; the same rule as
/// `CudaModel::load_part`.
fn slice_of(short: &str, part: &Partition, cfg: &minimax_shared::model::ModelConfig) -> Slice {
    if part.tp_world <= 1 {
        return Slice::All;
    }
    let heads = part.tp_range(cfg.n_heads);
    let kvh = part.tp_range(cfg.n_kv_heads);
    let f = part.tp_range(cfg.expert_ff);
    let (hd, vd) = (cfg.head_dim, cfg.v_head_dim);
    match short {
        names::ATTN_Q => Slice::Rows(heads.start * hd..heads.end * hd),
        names::ATTN_K => Slice::Rows(kvh.start * hd..kvh.end * hd),
        names::ATTN_V => Slice::Rows(kvh.start * vd..kvh.end * vd),
        names::ATTN_OUTPUT => Slice::Cols(heads.start * vd..heads.end * vd),
        names::ATTN_Q_NORM => Slice::Cols(heads.start * hd..heads.end * hd),
        names::ATTN_K_NORM => Slice::Cols(kvh.start * hd..kvh.end * hd),
        names::FFN_GATE_EXPS | names::FFN_UP_EXPS => Slice::Rows(f),
        names::FFN_DOWN_EXPS => Slice::Cols(f),
        _ => Slice::All,
    }
}

/// Strided device-to-device copy on the model's stream: `height` rows of `width` bytes.
fn copy_2d(g: &Gpu, src: u64, src_pitch: usize, dst: u64, dst_pitch: usize, width: usize, height: usize) -> Result<(), CudaError> {
    if height == 0 || width == 0 {
        return Ok(());
    }
    let c = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch,
        WidthInBytes: width,
        Height: height,
    };
    g.ctx.bind_to_thread()?;
    unsafe { sys::cuMemcpy2DAsync_v2(&c, g.stream.cu_stream()) }.result()?;
    Ok(())
}

impl CudaModel {
    /// A synthetic model (MiniMax-M2.7's dimensions, `spec`'s quant mix, random valid blocks
    /// filled on the device; benchmarks and tests) holding `part`'s share: tensor-parallel
    /// slices of every layer and/or a pipeline layer range. The same `seed` gives the same
    /// whole model whatever the partition. IQ4_XS/Q8_0 expert down columns of a rank whose
    /// slice is not whole 272-byte chunks (IQ4_XS at TP 2: 768 columns) are stored padded with
    /// zero blocks to whole chunks (row stride only; `cols` stays the slice width), so the fast
    /// path's chunked kernels can read them.
    pub fn synthetic_part(spec: &SyntheticSpec, part: Partition, kv: KvSpec, opts: CudaOptions, seed: u64) -> Result<Self, CudaError> {
        let cfg = spec.config();
        super::check_partition(&cfg, &part)?;
        if part.tp_world == 0 || part.tp_rank >= part.tp_world {
            return Err(CudaError::Shape(format!("tensor-parallel rank {} of {}", part.tp_rank, part.tp_world)));
        }
        for (what, n) in [("heads", cfg.n_heads), ("kv heads", cfg.n_kv_heads), ("expert width", cfg.expert_ff)] {
            if n % part.tp_world != 0 {
                return Err(CudaError::Shape(format!("tensor parallel {}: {what} {n} is not divisible", part.tp_world)));
            }
        }
        let gpu = Gpu::new(opts.device)?;
        let t0 = Instant::now();
        let mut bufs: Vec<CudaSlice<u8>> = Vec::new();
        let mut mats: std::collections::HashMap<String, DevMat> = std::collections::HashMap::new();
        let mut stats = LoadStats::default();
        // Whole-tensor scratch for sliced tensors (grown as needed, freed at the end).
        let mut scratch: Option<CudaSlice<u8>> = None;
        for (i, t) in spec.tensors().into_iter().enumerate() {
            let layer = t.name.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|l| l.parse::<usize>().ok());
            let short = t.name.splitn(3, '.').nth(2).filter(|_| layer.is_some()).unwrap_or(&t.name).to_string();
            let keep = match layer {
                Some(l) => part.layers.contains(&l),
                None if t.name == names::TOKEN_EMBD => part.first_stage || (cfg.tied_embeddings && part.last_stage),
                None => part.last_stage,
            };
            if !keep {
                continue;
            }
            let n_elems: usize = t.dims.iter().product::<u64>() as usize;
            let (lo, hi) = if t.name.ends_with("_norm.weight") {
                (0.9, 1.1)
            } else if t.name.ends_with(names::EXP_PROBS_B) {
                (0.0, 0.01)
            } else {
                (-0.05, 0.05)
            };
            let tseed = seed.wrapping_add((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let cols = t.dims[0] as usize;
            let rb = quant::row_bytes(t.ty, cols)?;
            let rows = t.dims.get(1).copied().unwrap_or(1) as usize;
            let n_experts = t.dims.get(2).copied().unwrap_or(0) as usize;
            let whole = t.n_bytes() as usize;
            let sl = slice_of(&short, &part, &cfg);
            let m = if sl == Slice::All {
                let buf = unsafe { gpu.stream.alloc::<u8>(whole.max(1)) }?;
                let p = gpu.ptr(&buf);
                gpu.fill_synthetic(p, t.ty, n_elems, tseed, lo, hi)?;
                bufs.push(buf);
                stats.bytes += whole;
                DevMat { ptr: p, ty: t.ty, rows, cols, row_bytes: rb, n_experts, expert_stride: rows * rb }
            } else {
                if scratch.as_ref().is_none_or(|s| s.len() < whole) {
                    drop(scratch.take());
                    scratch = Some(unsafe { gpu.stream.alloc::<u8>(whole) }?);
                }
                let sp = gpu.ptr(scratch.as_ref().unwrap());
                gpu.fill_synthetic(sp, t.ty, n_elems, tseed, lo, hi)?;
                let ne = n_experts.max(1);
                match sl {
                    Slice::Rows(r) => {
                        let n = ne * r.len() * rb;
                        let buf = unsafe { gpu.stream.alloc::<u8>(n.max(1)) }?;
                        let p = gpu.ptr(&buf);
                        copy_2d(&gpu, sp + (r.start * rb) as u64, rows * rb, p, r.len() * rb, r.len() * rb, ne)?;
                        bufs.push(buf);
                        stats.bytes += n;
                        DevMat { ptr: p, ty: t.ty, rows: r.len(), cols, row_bytes: rb, n_experts, expert_stride: r.len() * rb }
                    }
                    Slice::Cols(c) => {
                        let (be, bb) = (t.ty.block_elems(), t.ty.block_bytes());
                        if c.start % be != 0 || c.len() % be != 0 {
                            return Err(CudaError::Shape(format!(
                                "{}: tensor-parallel column slice {c:?} is not whole {:?} blocks of {be}",
                                t.name, t.ty
                            )));
                        }
                        let w = c.len() / be * bb;
                        let m = if short == names::FFN_DOWN_EXPS { super::super::fast::down_row_multiple(t.ty) } else { 1 };
                        let nrb = w.div_ceil(m) * m;
                        let n = ne * rows * nrb;
                        let mut buf = unsafe { gpu.stream.alloc::<u8>(n.max(1)) }?;
                        if nrb != w {
                            gpu.stream.memset_zeros(&mut buf)?;
                        }
                        let p = gpu.ptr(&buf);
                        copy_2d(&gpu, sp + (c.start / be * bb) as u64, rb, p, nrb, w, ne * rows)?;
                        bufs.push(buf);
                        stats.bytes += n;
                        DevMat { ptr: p, ty: t.ty, rows, cols: c.len(), row_bytes: nrb, n_experts, expert_stride: rows * nrb }
                    }
                    Slice::All => unreachable!(),
                }
            };
            stats.tensors += 1;
            mats.insert(t.name.clone(), m);
        }
        gpu.sync()?;
        drop(scratch);
        stats.seconds = t0.elapsed().as_secs_f64();
        tracing::info!(
            "synthetic weights on {} (layers {:?}, tp {}/{}): {} tensors, {:.3} GB filled in {:.2} s",
            gpu.name,
            part.layers,
            part.tp_rank,
            part.tp_world,
            stats.tensors,
            stats.bytes as f64 / 1e9,
            stats.seconds
        );
        let get = |n: &str| mats.get(n).copied().ok_or_else(|| CudaError::MissingTensor(n.to_string()));
        // Stages without the embedding / head get an empty placeholder (never read there).
        let none = super::absent_mat();
        let embd = if mats.contains_key(names::TOKEN_EMBD) { get(names::TOKEN_EMBD)? } else { none };
        let out_norm = if part.last_stage { get(names::OUTPUT_NORM)?.ptr } else { 0 };
        let head = if !part.last_stage {
            none
        } else if cfg.tied_embeddings {
            embd
        } else {
            get(names::OUTPUT)?
        };
        let mut layers = Vec::with_capacity(part.layers.len());
        for l in part.layers.clone() {
            let n = |s: &str| names::block(l, s);
            layers.push(Layer {
                attn_norm: get(&n(names::ATTN_NORM))?.ptr,
                wq: get(&n(names::ATTN_Q))?,
                wk: get(&n(names::ATTN_K))?,
                wv: get(&n(names::ATTN_V))?,
                wo: get(&n(names::ATTN_OUTPUT))?,
                q_norm: get(&n(names::ATTN_Q_NORM))?.ptr,
                k_norm: get(&n(names::ATTN_K_NORM))?.ptr,
                ffn_norm: get(&n(names::FFN_NORM))?.ptr,
                router: get(&n(names::FFN_GATE_INP))?,
                bias: get(&n(names::EXP_PROBS_B))?.ptr,
                gate: get(&n(names::FFN_GATE_EXPS))?,
                up: get(&n(names::FFN_UP_EXPS))?,
                down: get(&n(names::FFN_DOWN_EXPS))?,
            });
        }
        Self::finish(gpu, cfg, part, kv, opts, bufs, embd, out_norm, head, layers, stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use minimax_shared::model::synthetic::SyntheticSpec;

    #[test]
    fn tensor_slices_follow_load_part() {
        let cfg = SyntheticSpec::parse("m2.7:iq4xs:2").unwrap().config();
        let p1 = Partition::tensor(&cfg, 1, 2).unwrap();
        assert_eq!(slice_of(names::ATTN_Q, &p1, &cfg), Slice::Rows(24 * 128..48 * 128));
        assert_eq!(slice_of(names::ATTN_K, &p1, &cfg), Slice::Rows(4 * 128..8 * 128));
        assert_eq!(slice_of(names::ATTN_OUTPUT, &p1, &cfg), Slice::Cols(3072..6144));
        assert_eq!(slice_of(names::FFN_DOWN_EXPS, &p1, &cfg), Slice::Cols(768..1536));
        assert_eq!(slice_of(names::FFN_GATE_INP, &p1, &cfg), Slice::All);
        assert_eq!(slice_of(names::ATTN_Q, &Partition::whole(&cfg), &cfg), Slice::All);
    }
}
