//! BENCHMARK ONLY: the gateway's side of a synthetic model (`--synthetic m2.7:MIX[:LAYERS]`,
//! random weights on the ranks). The ranks have no GGUF, so the metadata the gateway reads
//! (tokenizer, chat template, name, context length) is built here: the tokenizer and template
//! of a small fixture GGUF, its vocabulary padded with unused tokens up to the synthetic
//! model's (200,064 for M2.7) so every id the model can produce decodes, and the synthetic
//! config's name and context length.

use std::path::Path;

use anyhow::{Context, bail};
use minimax_shared::gguf::{GgufModel, MetaValue, Metadata};
use minimax_shared::model::synthetic::SyntheticSpec;

const TOKENS: &str = "tokenizer.ggml.tokens";
const TYPES: &str = "tokenizer.ggml.token_type";
const SCORES: &str = "tokenizer.ggml.scores";
/// GGUF token type of padding ids (`UNUSED`).
const UNUSED: i32 = 5;

/// Metadata for serving `spec`: the tokenizer keys (and chat template) of `vocab_from`, padded
/// to the synthetic vocabulary, plus the synthetic architecture, name and context length.
pub fn metadata(spec: &SyntheticSpec, vocab_from: &Metadata) -> anyhow::Result<Metadata> {
    let cfg = spec.config();
    let tokens = vocab_from.get(TOKENS).and_then(MetaValue::as_array).context("the vocabulary GGUF has no tokenizer.ggml.tokens")?;
    let n = tokens.len();
    if n > cfg.vocab_size {
        bail!("the vocabulary GGUF has {n} tokens, more than the synthetic model's {}", cfg.vocab_size);
    }
    let pad = cfg.vocab_size - n;
    let mut out = Metadata::default();
    out.insert("general.architecture".into(), MetaValue::String(cfg.arch.clone()));
    out.insert("general.name".into(), MetaValue::String(cfg.name.clone().unwrap_or_default()));
    out.insert(format!("{}.context_length", cfg.arch), MetaValue::U32(cfg.context_length as u32));
    out.insert(format!("{}.block_count", cfg.arch), MetaValue::U32(cfg.n_layers as u32));
    for (k, v) in vocab_from.iter() {
        if !k.starts_with("tokenizer.") {
            continue;
        }
        let v = match (k, v) {
            (TOKENS, MetaValue::Array(a)) => {
                let mut a = a.clone();
                a.extend((n..cfg.vocab_size).map(|i| MetaValue::String(format!("<|synthetic_unused_{i}|>"))));
                MetaValue::Array(a)
            }
            (TYPES, MetaValue::Array(a)) if a.len() == n => {
                let mut a = a.clone();
                a.extend(std::iter::repeat_n(MetaValue::I32(UNUSED), pad));
                MetaValue::Array(a)
            }
            (SCORES, MetaValue::Array(a)) if a.len() == n => {
                let mut a = a.clone();
                a.extend(std::iter::repeat_n(MetaValue::F32(0.0), pad));
                MetaValue::Array(a)
            }
            _ => v.clone(),
        };
        out.insert(k.to_string(), v);
    }
    Ok(out)
}

/// [`metadata`] with the vocabulary read from the GGUF at `vocab_from`.
pub fn metadata_from_file(spec: &SyntheticSpec, vocab_from: &Path) -> anyhow::Result<Metadata> {
    let m = GgufModel::open(vocab_from).map_err(|e| anyhow::anyhow!("--synthetic-vocab-from {}: {e}", vocab_from.display()))?;
    metadata(spec, m.metadata())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::format::ModelFormat;
    use crate::text::tokenizer::Tokenizer;

    fn fixture() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/m2-small/q8_0.gguf")
    }

    #[test]
    fn fixture_vocab_is_padded_to_the_synthetic_model() {
        let spec = SyntheticSpec::parse("m2.7:iq4xs:2").unwrap();
        let small = GgufModel::open(fixture()).unwrap();
        let n = small.meta(TOKENS).unwrap().as_array().unwrap().len();
        let meta = metadata_from_file(&spec, &fixture()).unwrap();
        let tok = Tokenizer::from_gguf_metadata(&meta, &ModelFormat::minimax_m2()).unwrap();
        assert_eq!(tok.vocab_size(), 200_064);
        // Real tokens keep their ids and text; the padding decodes to its own marker.
        let real = Tokenizer::from_gguf_metadata(small.metadata(), &ModelFormat::minimax_m2()).unwrap();
        let ids = real.encode_trusted("hello world").unwrap();
        assert_eq!(tok.encode_trusted("hello world").unwrap(), ids);
        assert_eq!(tok.token_bytes(n as u32 - 1), real.token_bytes(n as u32 - 1));
        assert_eq!(tok.token_bytes(200_063), b"<|synthetic_unused_200063|>");
        let ctx = meta.get("minimax-m2.context_length").and_then(MetaValue::as_u64);
        assert_eq!(ctx, Some(spec.config().context_length as u64));
        assert!(meta.get("general.name").and_then(MetaValue::as_str).unwrap().contains("synthetic"));
        assert!(meta.get("tokenizer.chat_template").is_some() == small.meta("tokenizer.chat_template").is_some());
    }

    #[test]
    fn a_vocabulary_larger_than_the_model_is_refused() {
        let spec = SyntheticSpec::parse("m2.7:iq4xs:1").unwrap();
        let mut m = Metadata::default();
        m.insert(TOKENS.into(), MetaValue::Array(vec![MetaValue::String("a".into()); 200_065]));
        assert!(metadata(&spec, &m).unwrap_err().to_string().contains("200065"));
        assert!(metadata(&spec, &Metadata::default()).is_err());
    }
}
