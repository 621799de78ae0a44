//! Byte-level BPE tokenizer built from GGUF vocabulary metadata (no tokenizer.json needed).
//!
//! Plain text is always encoded *without* special-token recognition; only trusted text (the
//! chat template's own output, see `text::prompt`) goes through [`Tokenizer::encode_trusted`],
//! which matches control and user-defined token texts first, like HF's added-token split.

mod bytelevel;
mod gguf;
mod pretok;
mod spec;
mod specials;

use std::collections::{BTreeSet, HashSet};

use tokenizers::SplitDelimiterBehavior;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};

pub use bytelevel::ByteLevelMap;
pub use pretok::PreTokenizer;
pub use spec::{SpecError, TokenType, TokenizerSpec};
pub use specials::{Piece, SpecialTokens};

/// Encoding failed: the BPE met a byte its vocabulary cannot express.
#[derive(Debug, thiserror::Error)]
#[error("tokenization failed: {0}")]
pub struct EncodeError(String);

/// A ready tokenizer: encode plain or trusted text, decode ids to bytes.
pub struct Tokenizer {
    bpe: tokenizers::Tokenizer,
    token_bytes: Vec<Box<[u8]>>,
    token_types: Vec<TokenType>,
    specials: SpecialTokens,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    add_bos: bool,
    eog: BTreeSet<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.token_bytes.len())
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .field("eog", &self.eog)
            .finish()
    }
}

impl Tokenizer {
    /// Builds the tokenizer from plain vectors; checks every id and merge.
    pub fn from_spec(spec: TokenizerSpec) -> Result<Self, SpecError> {
        let n = spec.tokens.len();
        let token_types = if spec.token_types.is_empty() {
            vec![TokenType::Normal; n]
        } else if spec.token_types.len() != n {
            return Err(SpecError::LengthMismatch {
                what: "token types",
                got: spec.token_types.len(),
                tokens: n,
            });
        } else {
            spec.token_types.clone()
        };
        for (what, id) in [("bos", spec.bos_id), ("eos", spec.eos_id)] {
            if let Some(id) = id {
                check_id(what, id, n)?;
            }
        }
        for &id in &spec.extra_eog_ids {
            check_id("end-of-generation", id, n)?;
        }
        let pre = PreTokenizer::by_name(&spec.pre)?;

        // Merge results must stay reachable even if a special token happens to be one.
        let mut merges = Vec::with_capacity(spec.merges.len());
        let mut merge_results = HashSet::with_capacity(spec.merges.len());
        for (index, m) in spec.merges.iter().enumerate() {
            let mut parts = m.split(' ');
            let (Some(a), Some(b), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(SpecError::BadMerge {
                    index,
                    merge: m.clone(),
                    why: "expected exactly two parts",
                });
            };
            merge_results.insert(format!("{a}{b}"));
            merges.push((a.to_string(), b.to_string()));
        }
        // Special tokens are left out of the BPE vocabulary so plain text can never produce them.
        let mut vocab = tokenizers::models::bpe::Vocab::default();
        for (id, (tok, ty)) in spec.tokens.iter().zip(&token_types).enumerate() {
            if ty.is_special() && !merge_results.contains(tok) {
                continue;
            }
            vocab.entry(tok.clone()).or_insert(id as u32);
        }
        let model = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(pre.ignore_merges)
            .build()
            .map_err(|e| SpecError::Build(e.to_string()))?;
        let split = Split::new(
            SplitPattern::Regex(pre.pattern.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| SpecError::Build(format!("pre-tokenizer regex: {e}")))?;
        let pre_tok = Sequence::new(vec![
            PreTokenizerWrapper::Split(split),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)),
        ]);
        let mut bpe = tokenizers::Tokenizer::new(model);
        bpe.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(pre_tok)));

        let map = ByteLevelMap::new();
        let token_bytes = spec
            .tokens
            .iter()
            .zip(&token_types)
            .map(|(tok, ty)| {
                let bytes = if ty.is_special() {
                    None
                } else {
                    map.token_bytes(tok)
                };
                bytes
                    .unwrap_or_else(|| tok.as_bytes().to_vec())
                    .into_boxed_slice()
            })
            .collect();
        let specials = SpecialTokens::new(
            spec.tokens
                .iter()
                .zip(&token_types)
                .enumerate()
                .filter(|(_, (_, ty))| ty.is_special())
                .map(|(id, (tok, _))| (tok.clone(), id as u32))
                .collect(),
        );
        let mut eog: BTreeSet<u32> = spec.extra_eog_ids.iter().copied().collect();
        eog.extend(spec.eos_id);
        Ok(Tokenizer {
            bpe,
            token_bytes,
            token_types,
            specials,
            bos_id: spec.bos_id,
            eos_id: spec.eos_id,
            add_bos: spec.add_bos,
            eog,
        })
    }

    /// Number of token ids.
    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// Encodes untrusted text: special-token texts in it become ordinary BPE tokens.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>, EncodeError> {
        if text.is_empty() {
            return Ok(Vec::new());
        }
        let enc = self
            .bpe
            .encode(text, false)
            .map_err(|e| EncodeError(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Encodes trusted text (template output): special-token texts become their ids.
    pub fn encode_trusted(&self, text: &str) -> Result<Vec<u32>, EncodeError> {
        let mut out = Vec::new();
        for piece in self.specials.split(text) {
            match piece {
                Piece::Special(id) => out.push(id),
                Piece::Text(t) => out.extend(self.encode_plain(t)?),
            }
        }
        Ok(out)
    }

    /// Decodes ids to text, replacing invalid UTF-8 with U+FFFD; all tokens included.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The bytes one token stands for (empty for an out-of-range id).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.token_bytes
            .get(id as usize)
            .map(|b| &b[..])
            .unwrap_or(&[])
    }

    /// The GGUF type of a token (`Unused` for an out-of-range id).
    pub fn token_type(&self, id: u32) -> TokenType {
        self.token_types
            .get(id as usize)
            .copied()
            .unwrap_or(TokenType::Unused)
    }

    /// The special-token matcher.
    pub fn specials(&self) -> &SpecialTokens {
        &self.specials
    }

    /// Beginning-of-sequence id.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// End-of-sequence id.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// Text of a token, for template variables like `bos_token`.
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.token_bytes
            .get(id as usize)
            .map(|b| String::from_utf8_lossy(b).into_owned())
    }

    /// Whether prompts get a BOS prepended when they do not start with one.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether generating this id ends the turn.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// Every end-of-generation id, sorted.
    pub fn eog_ids(&self) -> Vec<u32> {
        self.eog.iter().copied().collect()
    }

    /// Prepends BOS when the vocabulary asks for it and the ids lack it.
    pub fn with_bos(&self, mut ids: Vec<u32>) -> Vec<u32> {
        if let (true, Some(bos)) = (self.add_bos, self.bos_id)
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        ids
    }
}

fn check_id(what: &'static str, id: u32, size: usize) -> Result<(), SpecError> {
    if (id as usize) < size {
        Ok(())
    } else {
        Err(SpecError::IdOutOfRange { what, id, size })
    }
}
