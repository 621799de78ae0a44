//! Known pre-tokenizers, by their GGUF `tokenizer.ggml.pre` name.

use super::spec::SpecError;

/// The split pattern of OpenAI's o200k (GPT-4o) encoding, as MiniMax-M2's tokenizer.json has it.
const O200K_PATTERN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// How text is split into words before BPE runs on each word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreTokenizer {
    /// The GGUF name.
    pub name: &'static str,
    /// The split regex (fancy-regex syntax), pieces kept isolated.
    pub pattern: &'static str,
    /// Whether a word found whole in the vocabulary skips the merges (tiktoken behaviour).
    pub ignore_merges: bool,
}

/// Every pre-tokenizer this server knows.
const KNOWN: &[PreTokenizer] = &[
    PreTokenizer {
        name: "minimax-m2",
        pattern: O200K_PATTERN,
        ignore_merges: false,
    },
    PreTokenizer {
        name: "gpt-4o",
        pattern: O200K_PATTERN,
        ignore_merges: false,
    },
];

impl PreTokenizer {
    /// Looks a name up; an unknown name is an error because guessing silently corrupts ids.
    pub fn by_name(name: &str) -> Result<Self, SpecError> {
        KNOWN
            .iter()
            .copied()
            .find(|p| p.name == name)
            .ok_or_else(|| SpecError::UnknownPreTokenizer {
                name: name.to_string(),
                known: KNOWN.iter().map(|p| p.name).collect::<Vec<_>>().join(", "),
            })
    }
}
