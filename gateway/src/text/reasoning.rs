//! Splitting model output into `reasoning_content` and `content`, chunk by chunk.
//!
//! M2's generation prompt ends inside `<think>\n`, so output starts as reasoning and switches to
//! content at `</think>`. Newlines next to the tags are the template's framing
//! (`<think>\n…\n</think>\n\n`) and are dropped, so re-rendering the parsed message gives back
//! the same prompt text. Tags split across chunks are held back until they resolve.

use crate::text::format::ReasoningTags;
use crate::text::tagscan::partial_tag_len;

/// Whether reasoning is split out or left in `content` verbatim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReasoningMode {
    /// Reasoning goes to `reasoning_content` (default).
    #[default]
    Parsed,
    /// Everything the model wrote goes to `content`, tags included.
    Raw,
}

impl ReasoningMode {
    /// Parses the `reasoning_format` value (llama.cpp spelling accepted: `none` means raw).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "none" | "raw" => Some(ReasoningMode::Raw),
            "parsed" | "auto" | "deepseek" | "minimax" => Some(ReasoningMode::Parsed),
            _ => None,
        }
    }
}

/// Text released by one step: each part may be empty.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SplitText {
    /// New reasoning text.
    pub reasoning: String,
    /// New content text.
    pub content: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing decided yet: the model may open a reasoning block itself.
    Start,
    /// Inside reasoning; `fresh` until the first non-newline character.
    Reasoning { fresh: bool },
    /// After reasoning; `fresh` until the first non-newline character after `</think>`.
    Content { fresh: bool },
}

/// Streaming reasoning/content splitter for one response.
#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    tags: ReasoningTags,
    mode: ReasoningMode,
    state: State,
    buf: String,
}

impl ReasoningSplitter {
    /// `in_reasoning`: the prompt ended inside an open reasoning block.
    pub fn new(tags: ReasoningTags, mode: ReasoningMode, in_reasoning: bool) -> Self {
        let state = if in_reasoning {
            State::Reasoning { fresh: true }
        } else {
            State::Start
        };
        ReasoningSplitter {
            tags,
            mode,
            state,
            buf: String::new(),
        }
    }

    /// Feeds decoded text; returns what can be released now.
    pub fn push(&mut self, text: &str) -> SplitText {
        let mut out = SplitText::default();
        if self.mode == ReasoningMode::Raw {
            out.content.push_str(text);
            return out;
        }
        self.buf.push_str(text);
        self.drain(&mut out, false);
        out
    }

    /// Ends the stream: held-back text is released where it belongs.
    pub fn finish(&mut self) -> SplitText {
        let mut out = SplitText::default();
        if self.mode == ReasoningMode::Raw {
            return out;
        }
        self.drain(&mut out, true);
        out
    }

    /// Whether the splitter is (still) inside reasoning.
    pub fn in_reasoning(&self) -> bool {
        matches!(self.state, State::Reasoning { .. })
    }

    fn drain(&mut self, out: &mut SplitText, end: bool) {
        loop {
            match self.state {
                State::Start => {
                    let trimmed = self.buf.trim_start();
                    if let Some(rest) = trimmed.strip_prefix(self.tags.open) {
                        self.buf = rest.to_string();
                        self.state = State::Reasoning { fresh: true };
                    } else if !end && (trimmed.is_empty() || self.tags.open.starts_with(trimmed)) {
                        return; // leading whitespace or a partial `<think>`: undecided
                    } else {
                        self.state = State::Content { fresh: false };
                    }
                }
                State::Reasoning { fresh } => {
                    if fresh {
                        let t = self.buf.trim_start_matches('\n');
                        if t.is_empty() && !end {
                            self.buf.clear();
                            return;
                        }
                        self.buf = t.to_string();
                        self.state = State::Reasoning { fresh: false };
                    }
                    if let Some(pos) = self.buf.find(self.tags.close) {
                        out.reasoning
                            .push_str(self.buf[..pos].trim_end_matches('\n'));
                        self.buf = self.buf[pos + self.tags.close.len()..].to_string();
                        self.state = State::Content { fresh: true };
                        continue;
                    }
                    if end {
                        out.reasoning.push_str(self.buf.trim_end_matches('\n'));
                        self.buf.clear();
                        return;
                    }
                    // Hold back a partial close tag and the newlines that may precede it.
                    let hold_from = self.buf.len() - partial_tag_len(&self.buf, self.tags.close);
                    let release = self.buf[..hold_from].trim_end_matches('\n').len();
                    out.reasoning.push_str(&self.buf[..release]);
                    self.buf.drain(..release);
                    return;
                }
                State::Content { fresh } => {
                    if fresh {
                        let t = self.buf.trim_start_matches('\n');
                        if t.is_empty() {
                            self.buf.clear();
                            return;
                        }
                        self.buf = t.to_string();
                        self.state = State::Content { fresh: false };
                    }
                    out.content.push_str(&self.buf);
                    self.buf.clear();
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::format::ModelFormat;

    fn run(chunks: &[&str], in_reasoning: bool) -> SplitText {
        let mut s = ReasoningSplitter::new(
            ModelFormat::minimax_m2().reasoning,
            ReasoningMode::Parsed,
            in_reasoning,
        );
        let mut all = SplitText::default();
        for c in chunks {
            let o = s.push(c);
            all.reasoning.push_str(&o.reasoning);
            all.content.push_str(&o.content);
        }
        let o = s.finish();
        all.reasoning.push_str(&o.reasoning);
        all.content.push_str(&o.content);
        all
    }

    #[test]
    fn every_split_point_gives_the_same_result() {
        let text = "Let me think.\nStep 1\n</think>\n\nThe answer is 4.\n";
        let want = SplitText {
            reasoning: "Let me think.\nStep 1".into(),
            content: "The answer is 4.\n".into(),
        };
        assert_eq!(run(&[text], true), want);
        let idx: Vec<usize> = (0..=text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        for &i in &idx {
            for &j in idx.iter().filter(|&&j| j >= i) {
                assert_eq!(
                    run(&[&text[..i], &text[i..j], &text[j..]], true),
                    want,
                    "split at {i},{j}"
                );
            }
        }
    }

    #[test]
    fn model_opened_block_and_no_block() {
        let want = SplitText {
            reasoning: "r".into(),
            content: "c".into(),
        };
        assert_eq!(run(&["  <th", "ink>\nr\n</think>\n\nc"], false), want);
        assert_eq!(
            run(&["just text <think> inside"], false).content,
            "just text <think> inside"
        );
        assert_eq!(run(&["<thi"], false).content, "<thi");
    }

    #[test]
    fn truncated_reasoning_stays_reasoning() {
        let out = run(&["thinking hard\n", "</thi"], true);
        assert_eq!(out.reasoning, "thinking hard\n</thi");
        assert_eq!(out.content, "");
    }

    #[test]
    fn raw_mode_passes_everything() {
        let mut s = ReasoningSplitter::new(
            ModelFormat::minimax_m2().reasoning,
            ReasoningMode::Raw,
            true,
        );
        assert_eq!(s.push("a\n</think>\n\nb").content, "a\n</think>\n\nb");
        assert_eq!(s.finish(), SplitText::default());
    }
}
