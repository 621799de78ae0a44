//! From generated token ids to OpenAI deltas: detokenize, split reasoning, parse tool calls,
//! enforce `tool_choice`, and tell the truth in `finish_reason`.

use std::sync::Arc;

use crate::text::detok::IncrementalDecoder;
use crate::text::format::ModelFormat;
use crate::text::reasoning::{ReasoningMode, ReasoningSplitter};
use crate::text::request::{ToolChoice, ToolSet};
use crate::text::tokenizer::{TokenType, Tokenizer};
use crate::text::toolcall::{CallIds, ParsedCall, ToolCallParser, ToolEvent};

/// One streamed change to the assistant message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    /// More `reasoning_content`.
    Reasoning(String),
    /// More `content`.
    Content(String),
    /// A tool call starts (`tool_calls[index]` with `id`, `type`, `function.name`).
    ToolCallStart {
        /// Position in `tool_calls`.
        index: usize,
        /// Call id.
        id: String,
        /// Function name.
        name: String,
    },
    /// More `function.arguments` text of call `index`.
    ToolCallArguments {
        /// Position in `tool_calls`.
        index: usize,
        /// Text to append.
        chunk: String,
    },
}

/// Why generation stopped, as the scheduler knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopCause {
    /// The model produced an end-of-generation token.
    EndOfGeneration,
    /// A stop sequence matched.
    StopSequence,
    /// `max_tokens` or the context length was reached.
    Length,
}

/// OpenAI `finish_reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// Natural end or stop sequence.
    Stop,
    /// Cut off by a length limit.
    Length,
    /// The answer ended with tool calls.
    ToolCalls,
}

impl FinishReason {
    /// The OpenAI spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// `tool_choice` demanded a call the model did not make; the response must say so.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ToolChoiceUnmet(pub String);

/// Everything known once the stream ends.
#[derive(Debug, Clone)]
pub struct Finished {
    /// Deltas released by flushing held-back text.
    pub deltas: Vec<Delta>,
    /// The truthful finish reason.
    pub finish_reason: FinishReason,
    /// All reasoning text.
    pub reasoning_content: String,
    /// All content text.
    pub content: String,
    /// Returned calls, with validity.
    pub tool_calls: Vec<ParsedCall>,
    /// Calls left out by `parallel_tool_calls: false`.
    pub dropped_tool_calls: usize,
    /// Set when `tool_choice` was `required` or named and no valid call came.
    pub tool_choice_error: Option<ToolChoiceUnmet>,
}

/// Per-request settings for [`OutputParser`].
#[derive(Debug, Clone)]
pub struct OutputOptions {
    /// Split reasoning or keep it raw.
    pub reasoning: ReasoningMode,
    /// The prompt ended inside an open reasoning block.
    pub starts_in_reasoning: bool,
    /// Tools of the request.
    pub tools: Arc<ToolSet>,
    /// What the model may call (`None`: no parsing, call-like text stays content).
    pub tool_choice: ToolChoice,
    /// `false` keeps only the first call.
    pub parallel_tool_calls: bool,
    /// Id generator for calls.
    pub call_ids: CallIds,
}

/// Turns one response's token stream into deltas.
pub struct OutputParser {
    tokenizer: Arc<Tokenizer>,
    format: ModelFormat,
    decoder: IncrementalDecoder,
    reasoning: ReasoningSplitter,
    tools: Option<ToolCallParser>,
    tool_choice: ToolChoice,
    reasoning_text: String,
    content_text: String,
}

impl OutputParser {
    /// A parser for one response.
    pub fn new(tokenizer: Arc<Tokenizer>, format: ModelFormat, opts: OutputOptions) -> Self {
        let reasoning = ReasoningSplitter::new(
            format.reasoning.clone(),
            opts.reasoning,
            opts.starts_in_reasoning,
        );
        let tools = (opts.tool_choice != ToolChoice::None && !opts.tools.is_empty()).then(|| {
            ToolCallParser::new(
                format.tool_calls.clone(),
                opts.tools.clone(),
                opts.tool_choice.clone(),
                opts.parallel_tool_calls,
                opts.call_ids.clone(),
            )
        });
        OutputParser {
            tokenizer,
            format,
            decoder: IncrementalDecoder::new(),
            reasoning,
            tools,
            tool_choice: opts.tool_choice,
            reasoning_text: String::new(),
            content_text: String::new(),
        }
    }

    /// Feeds one generated token. End-of-generation tokens and control tokens that carry no
    /// meaning for the parsers produce no text.
    pub fn push_token(&mut self, id: u32) -> Vec<Delta> {
        if self.tokenizer.is_eog(id) {
            return Vec::new();
        }
        if self.tokenizer.token_type(id) == TokenType::Control {
            let text = self.tokenizer.token_bytes(id);
            if !self
                .format
                .meaningful_tags()
                .iter()
                .any(|t| t.as_bytes() == text)
            {
                return Vec::new();
            }
        }
        let text = self.decoder.push(self.tokenizer.token_bytes(id));
        self.push_text(&text)
    }

    /// Feeds decoded text directly (tests, or text from another source).
    pub fn push_text(&mut self, text: &str) -> Vec<Delta> {
        if text.is_empty() {
            return Vec::new();
        }
        let split = self.reasoning.push(text);
        self.route(split.reasoning, split.content, false)
    }

    /// Ends the response.
    pub fn finish(mut self, cause: StopCause) -> Finished {
        let tail = self.decoder.finish();
        let mut deltas = self.push_text(&tail);
        let split = self.reasoning.finish();
        deltas.extend(self.route(split.reasoning, split.content, true));
        let (tool_calls, dropped) = match &self.tools {
            Some(p) => (p.calls().to_vec(), p.dropped()),
            None => (Vec::new(), 0),
        };
        let finish_reason = match cause {
            StopCause::Length => FinishReason::Length,
            _ if !tool_calls.is_empty() => FinishReason::ToolCalls,
            _ => FinishReason::Stop,
        };
        let valid = |c: &&ParsedCall| c.is_valid();
        let tool_choice_error = match &self.tool_choice {
            ToolChoice::Required if !tool_calls.iter().any(|c| valid(&c)) => {
                Some(ToolChoiceUnmet(unmet_message(
                    "tool_choice is `required` but the model made no valid tool call",
                    &tool_calls,
                )))
            }
            ToolChoice::Function(f) if !tool_calls.iter().filter(valid).any(|c| &c.name == f) => {
                Some(ToolChoiceUnmet(unmet_message(
                    &format!(
                        "tool_choice requires a call of `{f}` but the model made no valid one"
                    ),
                    &tool_calls,
                )))
            }
            _ => None,
        };
        Finished {
            deltas,
            finish_reason,
            reasoning_content: self.reasoning_text,
            content: self.content_text,
            tool_calls,
            dropped_tool_calls: dropped,
            tool_choice_error,
        }
    }

    fn route(&mut self, reasoning: String, content: String, end: bool) -> Vec<Delta> {
        let mut out = Vec::new();
        if !reasoning.is_empty() {
            self.reasoning_text.push_str(&reasoning);
            out.push(Delta::Reasoning(reasoning));
        }
        let events = match &mut self.tools {
            Some(p) => {
                let mut ev = if content.is_empty() {
                    Vec::new()
                } else {
                    p.push(&content)
                };
                if end {
                    ev.extend(p.finish());
                }
                ev
            }
            None if content.is_empty() => Vec::new(),
            None => vec![ToolEvent::Content(content)],
        };
        for ev in events {
            match ev {
                ToolEvent::Content(c) => {
                    self.content_text.push_str(&c);
                    match out.last_mut() {
                        Some(Delta::Content(prev)) => prev.push_str(&c),
                        _ => out.push(Delta::Content(c)),
                    }
                }
                ToolEvent::Start { index, id, name } => {
                    out.push(Delta::ToolCallStart { index, id, name })
                }
                ToolEvent::Args { index, chunk } => {
                    out.push(Delta::ToolCallArguments { index, chunk })
                }
            }
        }
        out
    }
}

fn unmet_message(head: &str, calls: &[ParsedCall]) -> String {
    let problems: Vec<String> = calls
        .iter()
        .flat_map(|c| {
            c.problems
                .iter()
                .map(move |p| format!("call {} `{}`: {p}", c.index, c.name))
        })
        .collect();
    if problems.is_empty() {
        head.to_string()
    } else {
        format!("{head} ({})", problems.join("; "))
    }
}
