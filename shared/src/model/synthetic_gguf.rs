//! A synthetic model (`SyntheticSpec`) written out as a real GGUF file, streamed tensor by
//! tensor: the weight loader can then be measured on files of tens of GB, and a backend that
//! only reads GGUF files (the CPU reference) can run the synthetic shapes too. Benchmarks
//! only: the weights are random valid blocks.

use std::io::{self, Write};

use super::names;
use super::ModelConfig;
use super::synthetic::{SplitMix64, SyntheticSpec, SyntheticTensor, fill_random_blocks};
use crate::gguf::{MetaValue, Metadata};
use crate::gguf::write::{GgufWriter, TensorSpec};
use crate::quant::GgmlType;

/// Largest block of random data generated per tensor; bigger tensors repeat it (the bytes
/// on disk are real, so reading them back costs what a real model's do).
const CHUNK: usize = 32 << 20;

/// The metadata `ModelConfig::from_gguf` reads, for config `c`.
pub fn metadata(c: &ModelConfig) -> GgufWriter {
    let a = c.arch.clone();
    let k = |s: &str| format!("{a}.{s}");
    let u = |v: usize| MetaValue::U32(v as u32);
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::String(a.clone()));
    w.meta("general.name", MetaValue::String(c.name.clone().unwrap_or_default()));
    w.meta(&k("block_count"), u(c.n_layers));
    w.meta(&k("context_length"), u(c.context_length));
    w.meta(&k("embedding_length"), u(c.hidden));
    w.meta(&k("attention.head_count"), u(c.n_heads));
    w.meta(&k("attention.head_count_kv"), u(c.n_kv_heads));
    w.meta(&k("attention.key_length"), u(c.head_dim));
    w.meta(&k("attention.value_length"), u(c.v_head_dim));
    w.meta(&k("rope.dimension_count"), u(c.rotary_dim));
    w.meta(&k("rope.freq_base"), MetaValue::F32(c.rope_theta));
    w.meta(&k("attention.layer_norm_rms_epsilon"), MetaValue::F32(c.rms_eps));
    w.meta(&k("expert_count"), u(c.n_experts));
    w.meta(&k("expert_used_count"), u(c.n_experts_used));
    w.meta(&k("expert_feed_forward_length"), u(c.expert_ff));
    let gating = match c.gating {
        super::GatingFunc::Softmax => 1,
        super::GatingFunc::Sigmoid => 2,
    };
    w.meta(&k("expert_gating_func"), u(gating));
    w
}

/// Random contents for one tensor: at most [`CHUNK`] bytes of whole blocks (norm weights in
/// [0.9, 1.1], the expert-selection bias in [0, 0.01], everything else small valid blocks).
fn sample(name: &str, ty: GgmlType, n_bytes: usize, rng: &mut SplitMix64) -> Vec<u8> {
    let bb = ty.block_bytes().max(1);
    let len = n_bytes.min(CHUNK / bb * bb);
    let mut buf = vec![0u8; len];
    let range = if name.ends_with("_norm.weight") {
        Some((0.9f32, 1.1f32))
    } else if name.ends_with(names::EXP_PROBS_B) {
        Some((0.0, 0.01))
    } else {
        None
    };
    match range {
        Some((lo, hi)) if ty == GgmlType::F32 => {
            for c in buf.chunks_exact_mut(4) {
                c.copy_from_slice(&(lo + (hi - lo) * rng.next_f32()).to_le_bytes());
            }
        }
        _ => fill_random_blocks(ty, rng, &mut buf),
    }
    buf
}

/// The `tokenizer.*` entries of `m`'s metadata: what [`write_gguf`] takes as `extra` so that a
/// synthetic file can be served through the gateway with `--model` (the gateway reads the
/// tokenizer from the served GGUF; `--synthetic` builds its tokenizer metadata itself).
pub fn tokenizer_meta(m: &Metadata) -> Vec<(String, MetaValue)> {
    m.iter().filter(|(k, _)| k.starts_with("tokenizer.")).map(|(k, v)| (k.to_string(), v.clone())).collect()
}

/// Writes `spec` as one GGUF file to `out`, with the `extra` metadata entries after the
/// model's own (e.g. [`tokenizer_meta`] of a real model); returns the bytes written.
pub fn write_gguf(spec: &SyntheticSpec, seed: u64, extra: &[(String, MetaValue)], out: &mut impl Write) -> io::Result<u64> {
    write_model(&spec.config(), &spec.tensors(), seed, extra, out)
}

/// Writes config `c` with `tensors` (names, shapes, types) and random contents.
fn write_model(c: &ModelConfig, tensors: &[SyntheticTensor], seed: u64, extra: &[(String, MetaValue)], out: &mut impl Write) -> io::Result<u64> {
    let sizes: Vec<u64> = tensors.iter().map(|t| t.n_bytes()).collect();
    let specs: Vec<TensorSpec<'_>> =
        tensors.iter().zip(&sizes).map(|(t, &n)| TensorSpec { name: &t.name, dims: &t.dims, ty: t.ty, n_bytes: n }).collect();
    let mut meta = metadata(c);
    for (k, v) in extra {
        meta.meta(k, v.clone());
    }
    let (header, offsets) = meta.header_for(&specs);
    out.write_all(&header)?;
    let mut at = 0u64;
    let zeros = [0u8; 256];
    let mut rng = SplitMix64(seed);
    for ((t, &n), &off) in tensors.iter().zip(&sizes).zip(&offsets) {
        while at < off {
            let pad = (off - at).min(zeros.len() as u64) as usize;
            out.write_all(&zeros[..pad])?;
            at += pad as u64;
        }
        let buf = sample(&t.name, t.ty, n as usize, &mut rng);
        let mut left = n as usize;
        while left > 0 {
            let w = left.min(buf.len());
            out.write_all(&buf[..w])?;
            left -= w;
        }
        at += n;
    }
    Ok(header.len() as u64 + at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgufFile, GgufModel};
    use crate::model::ModelConfig;
    use crate::quant;

    /// M2.7's layout and types at toy width (the real shapes are gigabytes).
    fn small() -> (ModelConfig, Vec<SyntheticTensor>) {
        let spec = SyntheticSpec::parse("m2.7:iq4xs:2").unwrap();
        let mut c = spec.config();
        (c.hidden, c.n_heads, c.n_kv_heads, c.n_experts, c.n_experts_used, c.expert_ff, c.vocab_size) = (256, 4, 2, 8, 2, 512, 260_000);
        let tensors = c
            .expected_shapes()
            .into_iter()
            .map(|(name, dims)| {
                let short = name.splitn(3, '.').nth(2).filter(|_| name.starts_with("blk.")).unwrap_or(&name).to_string();
                SyntheticTensor { ty: spec.type_of(&short), name, dims }
            })
            .collect();
        (c, tensors)
    }

    #[test]
    fn written_file_parses_with_the_config_and_valid_blocks() {
        let (c, tensors) = small();
        // Extra entries (a tokenizer taken from another model) go into the header as given.
        let mut src = Metadata::default();
        src.insert("general.name".into(), MetaValue::String("other".into()));
        src.insert("tokenizer.ggml.model".into(), MetaValue::String("gpt2".into()));
        src.insert("tokenizer.ggml.tokens".into(), MetaValue::Array(vec![MetaValue::String("a".into()), MetaValue::String("b".into())]));
        let extra = tokenizer_meta(&src);
        assert_eq!(extra.len(), 2, "only the tokenizer.* entries: {extra:?}");
        let mut bytes = Vec::new();
        let n = write_model(&c, &tensors, 3, &extra, &mut bytes).unwrap();
        assert_eq!(n as usize, bytes.len());
        let m = GgufModel::from_shards(vec![GgufFile::from_bytes("synthetic.gguf", bytes).unwrap()]).unwrap();
        assert_eq!(ModelConfig::from_gguf(&m).unwrap(), c);
        for (k, v) in &extra {
            assert_eq!(m.meta(k), Some(v), "{k}");
        }
        assert_ne!(m.meta("general.name"), src.get("general.name"), "only tokenizer entries are copied");
        assert_eq!(m.tensor_count(), tensors.len());
        // Norm weights in [0.9, 1.1]; quantized matrices dequantize to small finite values,
        // including the repeated tail of a tensor larger than one chunk.
        let norm = m.tensor(&names::block(1, names::ATTN_NORM)).unwrap();
        let v = quant::dequantize_to_vec(norm.info.ty, norm.data, norm.info.n_elems() as usize).unwrap();
        assert!(v.iter().all(|x| (0.9..=1.1).contains(x)), "{:?}", &v[..4]);
        let e = m.tensor(names::TOKEN_EMBD).unwrap();
        assert_eq!(e.info.ty, GgmlType::IQ4_XS);
        assert!(e.data.len() > CHUNK, "{}", e.data.len());
        let rb = e.info.row_bytes();
        for row in [&e.data[..rb], &e.data[e.data.len() - rb..]] {
            let v = quant::dequantize_to_vec(e.info.ty, row, e.info.row_len()).unwrap();
            assert!(v.iter().all(|x| x.is_finite() && x.abs() < 0.1) && v.iter().any(|&x| x != 0.0));
        }
        let g = m.tensor(&names::block(0, names::FFN_GATE_EXPS)).unwrap();
        assert_eq!(g.info.ty, GgmlType::IQ4_XS);
        let v = quant::dequantize_to_vec(g.info.ty, g.data, g.info.n_elems() as usize).unwrap();
        assert!(v.iter().all(|x| x.is_finite() && x.abs() < 0.1));
    }
}
