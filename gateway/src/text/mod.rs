//! Text pipeline: tokenizer, chat template, reasoning and tool-call parsing.
//!
//! Requests flow `request` (validation) → `prompt` (template + sanitized tokenization); model
//! output flows `output` (detok → `reasoning` → `toolcall`). The model family's tags live in
//! `format`. See `docs/TEXT_PIPELINE.md`.

pub mod detok;
pub mod format;
pub mod output;
pub mod prompt;
pub mod reasoning;
pub mod request;
pub mod sanitize;
pub mod tagscan;
pub mod template;
pub mod tokenizer;
pub mod toolcall;
