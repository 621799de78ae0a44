//! The plain-data description of a vocabulary, as a GGUF stores it.

use thiserror::Error;

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// An ordinary BPE token.
    Normal,
    /// The unknown-token placeholder.
    Unknown,
    /// A control token: only the chat template may produce it (`[e~[`, `]~b]`, ...).
    Control,
    /// An added token matched verbatim in template output (`<think>`, ...).
    UserDefined,
    /// A reserved slot that never appears in text.
    Unused,
    /// A raw byte token (`<0x0A>`), used by SentencePiece-style vocabularies.
    Byte,
}

impl TokenType {
    /// Maps the GGUF integer code; unknown codes are an error so a new format is noticed.
    pub fn from_code(code: i64) -> Result<Self, SpecError> {
        Ok(match code {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            // 0 is "undefined" in llama.cpp and treated as normal there too.
            0 => TokenType::Normal,
            other => return Err(SpecError::BadTokenType(other)),
        })
    }

    /// Whether the token is matched as a whole in template output instead of by BPE.
    pub fn is_special(self) -> bool {
        matches!(self, TokenType::Control | TokenType::UserDefined)
    }
}

/// Everything needed to build a [`super::Tokenizer`], independent of the file format.
#[derive(Debug, Clone, Default)]
pub struct TokenizerSpec {
    /// Token strings, indexed by id (byte-level encoded for normal tokens).
    pub tokens: Vec<String>,
    /// Type of each token; empty means "all normal".
    pub token_types: Vec<TokenType>,
    /// BPE merges as `"left right"` strings, highest priority first.
    pub merges: Vec<String>,
    /// Pre-tokenizer name (`tokenizer.ggml.pre`), e.g. `minimax-m2`.
    pub pre: String,
    /// Beginning-of-sequence token.
    pub bos_id: Option<u32>,
    /// End-of-sequence token.
    pub eos_id: Option<u32>,
    /// Whether plain-text prompts get a BOS prepended.
    pub add_bos: bool,
    /// Extra end-of-generation ids (eot, eom, family-specific markers).
    pub extra_eog_ids: Vec<u32>,
}

/// Why a vocabulary description cannot become a tokenizer.
#[derive(Debug, Error)]
pub enum SpecError {
    /// The GGUF lacks a key the tokenizer needs.
    #[error("GGUF metadata has no `{0}`")]
    MissingKey(&'static str),
    /// A key exists with the wrong type or shape.
    #[error("GGUF metadata `{key}` is malformed: {why}")]
    BadKey {
        /// The metadata key.
        key: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// `tokenizer.ggml.model` names a vocabulary kind we do not implement.
    #[error("tokenizer model `{0}` is not supported (only byte-level BPE `gpt2`)")]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer we do not know.
    #[error("pre-tokenizer `{name}` is not known; known: {known}")]
    UnknownPreTokenizer {
        /// The name from the GGUF.
        name: String,
        /// Comma-separated known names.
        known: String,
    },
    /// A token-type code outside 0..=6.
    #[error("token type {0} is not a known GGUF token type")]
    BadTokenType(i64),
    /// Two vectors that must line up do not.
    #[error("{what}: {got} entries for {tokens} tokens")]
    LengthMismatch {
        /// Which vector.
        what: &'static str,
        /// Its length.
        got: usize,
        /// Number of tokens.
        tokens: usize,
    },
    /// A special id points past the vocabulary.
    #[error("{what} id {id} is outside the vocabulary of {size}")]
    IdOutOfRange {
        /// Which id.
        what: &'static str,
        /// The id.
        id: u32,
        /// Vocabulary size.
        size: usize,
    },
    /// A merge line is not `"a b"` or references unknown tokens.
    #[error("merge #{index} `{merge}` is invalid: {why}")]
    BadMerge {
        /// Position in the merge list.
        index: usize,
        /// The merge text.
        merge: String,
        /// What is wrong.
        why: &'static str,
    },
    /// The tokenizers crate refused the model.
    #[error("building the BPE model failed: {0}")]
    Build(String),
    /// The GGUF file could not be read.
    #[error("reading the GGUF failed: {0}")]
    Gguf(String),
}
