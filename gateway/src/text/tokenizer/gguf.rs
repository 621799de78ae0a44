//! Reading a [`TokenizerSpec`] from GGUF metadata (llama.cpp's `tokenizer.ggml.*` keys).

use std::path::Path;

use minimax_shared::gguf::{GgufModel, MetaValue, Metadata};

use super::Tokenizer;
use super::spec::{SpecError, TokenType, TokenizerSpec};
use crate::text::format::ModelFormat;

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TYPES: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const KEY_EOT: &str = "tokenizer.ggml.eot_token_id";
const KEY_EOM: &str = "tokenizer.ggml.eom_token_id";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";

impl TokenizerSpec {
    /// Collects the vocabulary from GGUF metadata; `format` adds the family's end-of-turn texts
    /// to the end-of-generation set.
    pub fn from_gguf_metadata(meta: &Metadata, format: &ModelFormat) -> Result<Self, SpecError> {
        let model = meta
            .get(KEY_MODEL)
            .map(|v| str_of(KEY_MODEL, v))
            .transpose()?;
        match model {
            Some("gpt2") => {}
            Some(other) => return Err(SpecError::UnsupportedModel(other.to_string())),
            None => return Err(SpecError::MissingKey(KEY_MODEL)),
        }
        let tokens = string_array(meta, KEY_TOKENS)?.ok_or(SpecError::MissingKey(KEY_TOKENS))?;
        let merges = string_array(meta, KEY_MERGES)?.ok_or(SpecError::MissingKey(KEY_MERGES))?;
        let token_types = match meta.get(KEY_TYPES) {
            None => Vec::new(),
            Some(v) => {
                let arr = v.as_array().ok_or_else(|| bad(KEY_TYPES, "not an array"))?;
                arr.iter()
                    .map(|x| {
                        x.as_i64()
                            .ok_or_else(|| bad(KEY_TYPES, "non-integer entry"))
                            .and_then(TokenType::from_code)
                    })
                    .collect::<Result<_, _>>()?
            }
        };
        let pre = meta
            .get(KEY_PRE)
            .map(|v| str_of(KEY_PRE, v).map(str::to_string))
            .transpose()?
            .ok_or(SpecError::MissingKey(KEY_PRE))?;
        let id = |key: &'static str| -> Result<Option<u32>, SpecError> {
            meta.get(key)
                .map(|v| {
                    v.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or_else(|| bad(key, "not a token id"))
                })
                .transpose()
        };
        let add_bos = match meta.get(KEY_ADD_BOS) {
            None => false,
            Some(v) => v.as_bool().ok_or_else(|| bad(KEY_ADD_BOS, "not a bool"))?,
        };
        let mut extra_eog_ids: Vec<u32> =
            [id(KEY_EOT)?, id(KEY_EOM)?].into_iter().flatten().collect();
        for text in format.end_of_generation {
            if let Some(pos) = tokens.iter().position(|t| t == text) {
                extra_eog_ids.push(pos as u32);
            }
        }
        Ok(TokenizerSpec {
            tokens,
            token_types,
            merges,
            pre,
            bos_id: id(KEY_BOS)?,
            eos_id: id(KEY_EOS)?,
            add_bos,
            extra_eog_ids,
        })
    }
}

impl Tokenizer {
    /// Builds the tokenizer from a GGUF model's metadata.
    pub fn from_gguf_metadata(meta: &Metadata, format: &ModelFormat) -> Result<Self, SpecError> {
        Tokenizer::from_spec(TokenizerSpec::from_gguf_metadata(meta, format)?)
    }

    /// Opens a GGUF file (or split directory) and builds the tokenizer from it.
    pub fn from_gguf(path: impl AsRef<Path>, format: &ModelFormat) -> Result<Self, SpecError> {
        let model = GgufModel::open(path).map_err(|e| SpecError::Gguf(e.to_string()))?;
        Self::from_gguf_metadata(model.metadata(), format)
    }
}

fn bad(key: &'static str, why: &str) -> SpecError {
    SpecError::BadKey {
        key,
        why: why.to_string(),
    }
}

fn str_of<'a>(key: &'static str, v: &'a MetaValue) -> Result<&'a str, SpecError> {
    v.as_str().ok_or_else(|| bad(key, "not a string"))
}

fn string_array(meta: &Metadata, key: &'static str) -> Result<Option<Vec<String>>, SpecError> {
    let Some(v) = meta.get(key) else {
        return Ok(None);
    };
    let arr = v.as_array().ok_or_else(|| bad(key, "not an array"))?;
    arr.iter()
        .map(|x| str_of(key, x).map(str::to_string))
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}
