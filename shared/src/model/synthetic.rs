//! Synthetic models for benchmarks: MiniMax-M2.7's exact dimensions with a chosen quant mix
//! and random *valid* blocks (finite, small scales), so real-scale speed can be measured
//! without downloading 128 GB. Routing on random weights is roughly uniform, which real
//! traffic is not: benchmark notes must say so. Never used by the serving path unless the
//! operator asks for it explicitly.

use super::config::{GatingFunc, ModelConfig};
use super::names;
use crate::quant::GgmlType;

/// A parsed `--synthetic BASE:MIX[:LAYERS]` spec, e.g. `m2.7:iq4xs` or `m2.7:q4km:8`.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticSpec {
    pub base: SyntheticBase,
    pub mix: QuantMix,
    pub layers: usize,
}

/// Which real model's dimensions to copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyntheticBase {
    /// MiniMax-M2 / M2.1 / M2.5 / M2.7 (same shapes): 62 layers, hidden 3072, 48/8 heads of
    /// 128 (rotary 64), 256 experts top-8 of width 1536, vocab 200064.
    M2,
}

/// Which ggml type each kind of tensor gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMix {
    /// IQ4_XS experts and embeddings, Q8_0 attention, Q6_K output: the 114.8 GiB llama.cpp
    /// comparison file, tensor for tensor (what llama.cpp's IQ4_XS recipe gives the embedding
    /// and the output head).
    Iq4Xs,
    /// [`QuantMix::Iq4Xs`] with Q8_0 embeddings and output (115.3 GiB): sessions 1-25's
    /// benchmark model, kept so old figures can be reproduced.
    Iq4XsQ8Out,
    /// A Q4_K_M-like mix: Q4_K experts with Q6_K down, Q4_K q/k/o, Q6_K v, Q6_K output, Q4_K
    /// embeddings.
    Q4KM,
    /// Everything Q8_0.
    Q8_0,
}

/// A spec that cannot be parsed.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("--synthetic {spec:?}: {detail} (expected BASE:MIX[:LAYERS], BASE = m2 | m2.1 | m2.5 | m2.7, MIX = iq4xs | iq4xs-q8out | q4km | q8_0)")]
pub struct SyntheticError {
    pub spec: String,
    pub detail: String,
}

/// One tensor of a synthetic model.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticTensor {
    pub name: String,
    /// ggml order, as a GGUF file would store it.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
}

impl SyntheticTensor {
    /// Bytes of the tensor's data.
    pub fn n_bytes(&self) -> u64 {
        self.ty.bytes_for(self.dims.iter().product()).expect("synthetic shapes are whole blocks")
    }
}

impl SyntheticSpec {
    /// Parses `BASE:MIX[:LAYERS]`.
    pub fn parse(spec: &str) -> Result<Self, SyntheticError> {
        let err = |detail: &str| SyntheticError { spec: spec.to_string(), detail: detail.to_string() };
        let parts: Vec<&str> = spec.split(':').collect();
        if !(2..=3).contains(&parts.len()) {
            return Err(err("wrong number of fields"));
        }
        let base = match parts[0].to_ascii_lowercase().as_str() {
            "m2" | "m2.1" | "m2.5" | "m2.7" => SyntheticBase::M2,
            _ => return Err(err("unknown base model")),
        };
        let mix = match parts[1].to_ascii_lowercase().replace('-', "_").as_str() {
            "iq4xs" | "iq4_xs" => QuantMix::Iq4Xs,
            "iq4xs_q8out" | "iq4_xs_q8out" => QuantMix::Iq4XsQ8Out,
            "q4km" | "q4_k_m" => QuantMix::Q4KM,
            "q8_0" | "q8" => QuantMix::Q8_0,
            _ => return Err(err("unknown quant mix")),
        };
        let full = Self::base_config(base).n_layers;
        let layers = match parts.get(2) {
            None => full,
            Some(l) => match l.parse::<usize>() {
                Ok(n) if (1..=full).contains(&n) => n,
                _ => return Err(err(&format!("LAYERS must be 1..={full}"))),
            },
        };
        Ok(Self { base, mix, layers })
    }

    fn base_config(base: SyntheticBase) -> ModelConfig {
        match base {
            SyntheticBase::M2 => ModelConfig {
                arch: "minimax-m2".into(),
                name: Some("synthetic MiniMax-M2.7".into()),
                n_layers: 62,
                hidden: 3072,
                n_heads: 48,
                n_kv_heads: 8,
                head_dim: 128,
                v_head_dim: 128,
                rotary_dim: 64,
                rope_theta: 5_000_000.0,
                rms_eps: 1e-6,
                n_experts: 256,
                n_experts_used: 8,
                expert_ff: 1536,
                gating: GatingFunc::Sigmoid,
                context_length: 196_608,
                vocab_size: 200_064,
                tied_embeddings: false,
            },
        }
    }

    /// The model config (with `layers` layers).
    pub fn config(&self) -> ModelConfig {
        let mut c = Self::base_config(self.base);
        c.n_layers = self.layers;
        c.name = Some(format!("synthetic MiniMax-M2.7 {:?} ({} layers)", self.mix, self.layers));
        c
    }

    /// The ggml type a tensor gets under this mix (`name` without the `blk.N.` prefix).
    pub fn type_of(&self, name: &str) -> GgmlType {
        use GgmlType as T;
        if name.ends_with("_norm.weight") || name == names::EXP_PROBS_B || name == names::FFN_GATE_INP {
            return T::F32;
        }
        match self.mix {
            QuantMix::Q8_0 => T::Q8_0,
            QuantMix::Iq4Xs | QuantMix::Iq4XsQ8Out => match name {
                names::FFN_GATE_EXPS | names::FFN_UP_EXPS | names::FFN_DOWN_EXPS => T::IQ4_XS,
                names::TOKEN_EMBD if self.mix == QuantMix::Iq4Xs => T::IQ4_XS,
                names::OUTPUT if self.mix == QuantMix::Iq4Xs => T::Q6_K,
                _ => T::Q8_0,
            },
            QuantMix::Q4KM => match name {
                names::FFN_DOWN_EXPS | names::ATTN_V | names::OUTPUT => T::Q6_K,
                _ => T::Q4_K,
            },
        }
    }

    /// Every tensor with its GGUF shape and type, in the order a converter writes them.
    pub fn tensors(&self) -> Vec<SyntheticTensor> {
        let c = self.config();
        c.expected_shapes()
            .into_iter()
            .map(|(name, dims)| {
                let short = name.splitn(3, '.').nth(2).filter(|_| name.starts_with("blk.")).unwrap_or(&name).to_string();
                let ty = self.type_of(&short);
                SyntheticTensor { name, dims, ty }
            })
            .collect()
    }

    /// Total bytes of weights.
    pub fn total_bytes(&self) -> u64 {
        self.tensors().iter().map(SyntheticTensor::n_bytes).sum()
    }
}

/// A small deterministic generator (SplitMix64) so host and device fills can agree.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
}

/// The synthetic fill's K-quant min scale as a multiple of the block scale (`dmin = r · d`,
/// 0: independent): the mean quant code (7.5 for Q4_K, 15.5 for Q5_K), so that with independent
/// uniform sub-scales and sub-mins the weights are zero-mean, as trained weights are. Equal
/// ranges (the old fill) gave every weight a +0.01 bias, a common mode that grows through the
/// layers and turns q8 activation rounding into router flips.
pub fn kquant_min_ratio(ty: GgmlType) -> f32 {
    match ty {
        GgmlType::Q4_K => 7.5,
        GgmlType::Q5_K => 15.5,
        _ => 0.0,
    }
}

/// Fills `out` (whole blocks of `ty`) with random valid blocks: random quant bits and small
/// finite scales (|w| around 0.01-0.05), so activations stay finite through many layers.
pub fn fill_random_blocks(ty: GgmlType, rng: &mut SplitMix64, out: &mut [u8]) {
    for chunk in out.chunks_mut(8) {
        let r = rng.next_u64().to_le_bytes();
        chunk.copy_from_slice(&r[..chunk.len()]);
    }
    let bb = ty.block_bytes();
    let scale = |rng: &mut SplitMix64, lo: f32, hi: f32| lo + (hi - lo) * rng.next_f32();
    match ty {
        GgmlType::F32 => {
            for c in out.chunks_exact_mut(4) {
                c.copy_from_slice(&(scale(rng, -0.05, 0.05)).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in out.chunks_exact_mut(2) {
                put_f16(c, 0, scale(rng, -0.05, 0.05));
            }
        }
        GgmlType::BF16 => {
            for c in out.chunks_exact_mut(2) {
                let bits = (scale(rng, -0.05, 0.05).to_bits() >> 16) as u16;
                c.copy_from_slice(&bits.to_le_bytes());
            }
        }
        _ => {
            for b in out.chunks_exact_mut(bb) {
                match ty {
                    GgmlType::Q8_0 => put_f16(b, 0, scale(rng, 1e-4, 4e-4)),
                    GgmlType::Q4_0 | GgmlType::Q5_0 => put_f16(b, 0, scale(rng, 1e-3, 3e-3)),
                    // Codebook values reach 127, IQ4_XS sub-scales 31 more.
                    GgmlType::IQ4_NL => put_f16(b, 0, scale(rng, 1e-4, 3e-4)),
                    GgmlType::IQ4_XS => put_f16(b, 0, scale(rng, 4e-6, 1.2e-5)),
                    GgmlType::Q4_1 | GgmlType::Q5_1 => {
                        put_f16(b, 0, scale(rng, 2e-3, 6e-3));
                        put_f16(b, 2, -scale(rng, 0.02, 0.05));
                    }
                    GgmlType::Q2_K => {
                        put_f16(b, 80, scale(rng, 1e-3, 3e-3));
                        put_f16(b, 82, scale(rng, 1e-3, 3e-3));
                    }
                    GgmlType::Q3_K => put_f16(b, 108, scale(rng, 1e-4, 4e-4)),
                    GgmlType::Q4_K | GgmlType::Q5_K => {
                        let d = scale(rng, 2e-5, 8e-5);
                        put_f16(b, 0, d);
                        put_f16(b, 2, d * kquant_min_ratio(ty));
                    }
                    GgmlType::Q6_K => put_f16(b, 208, scale(rng, 2e-5, 6e-5)),
                    // e8m0 exponent: values 2^(e-128) * {0..12}; 118..122 keeps |w| <= 0.05.
                    GgmlType::MXFP4 => b[0] = 118 + (rng.next_u64() % 5) as u8,
                    _ => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant;

    #[test]
    fn parse_specs_and_errors() {
        let s = SyntheticSpec::parse("m2.7:iq4xs").unwrap();
        assert_eq!((s.base, s.mix, s.layers), (SyntheticBase::M2, QuantMix::Iq4Xs, 62));
        assert_eq!(SyntheticSpec::parse("M2.7:Q4_K_M:8").unwrap().layers, 8);
        for bad in ["m3:iq4xs", "m2.7", "m2.7:iq2", "m2.7:q8_0:0", "m2.7:q8_0:63", "m2.7:q8_0:x:y"] {
            let e = SyntheticSpec::parse(bad).unwrap_err();
            assert!(e.to_string().contains(bad), "{e}");
        }
    }

    #[test]
    fn iq4xs_mix_is_the_114_8_gib_comparison_model() {
        let s = SyntheticSpec::parse("m2.7:iq4xs").unwrap();
        let gib = s.total_bytes() as f64 / (1u64 << 30) as f64;
        assert!((gib - 114.8).abs() < 0.05, "{gib:.2} GiB");
        let old = SyntheticSpec::parse("m2.7:iq4xs-q8out").unwrap();
        let gib_old = old.total_bytes() as f64 / (1u64 << 30) as f64;
        assert!((gib_old - 115.27).abs() < 0.05, "{gib_old:.2} GiB");
        let t = s.tensors();
        assert_eq!(t.len(), 3 + 62 * 13);
        let gate = t.iter().find(|t| t.name == "blk.61.ffn_gate_exps.weight").unwrap();
        assert_eq!((gate.dims.clone(), gate.ty), (vec![3072, 1536, 256], GgmlType::IQ4_XS));
        let router = t.iter().find(|t| t.name == "blk.0.ffn_gate_inp.weight").unwrap();
        assert_eq!(router.ty, GgmlType::F32);
        let ty = |s: &SyntheticSpec, n: &str| s.tensors().into_iter().find(|t| t.name == n).unwrap().ty;
        assert_eq!((ty(&s, "output.weight"), ty(&s, "token_embd.weight")), (GgmlType::Q6_K, GgmlType::IQ4_XS));
        assert_eq!((ty(&old, "output.weight"), ty(&old, "token_embd.weight")), (GgmlType::Q8_0, GgmlType::Q8_0));
        assert_eq!(ty(&old, "blk.3.ffn_down_exps.weight"), GgmlType::IQ4_XS);
        let q4km = SyntheticSpec::parse("m2.7:q4km").unwrap();
        assert_eq!(q4km.type_of("ffn_down_exps.weight"), GgmlType::Q6_K);
    }

    #[test]
    fn random_blocks_dequantize_to_small_finite_values() {
        let mut rng = SplitMix64(42);
        for ty in GgmlType::ALL.into_iter().filter(|t| t.is_supported()) {
            let n = 256 * 8;
            let mut bytes = vec![0u8; ty.bytes_for(n as u64).unwrap() as usize];
            fill_random_blocks(ty, &mut rng, &mut bytes);
            let v = quant::dequantize_to_vec(ty, &bytes, n).unwrap();
            let max = v.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert!(v.iter().all(|x| x.is_finite()), "{ty}");
            assert!(max > 1e-3 && max < 0.25, "{ty}: max |w| = {max}");
        }
    }
}
