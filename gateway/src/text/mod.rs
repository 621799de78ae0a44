//! Text pipeline: tokenizer, chat template, reasoning and tool-call parsing.
