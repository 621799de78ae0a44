//! Text pipeline: tokenizer, chat template, reasoning and tool-call parsing.
//!
//! See `docs/TEXT_PIPELINE.md` for the flow and where a new model family plugs in.

pub mod detok;
pub mod format;
pub mod tokenizer;
pub mod template;
