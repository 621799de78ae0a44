//! Structured outputs: constrained decoding to a JSON Schema (`response_format`).
//!
//! The gateway keeps, per request, a byte matcher of the schema ([`matcher`]) and, before each
//! sampled step, sends the head rank the set of tokens that keep the document valid (a bit mask
//! over the vocabulary, `SamplingSpec.allowed_tokens`). The rank removes every other token
//! *before* temperature and the top-k / top-p / min-p cuts (as a logit bias of −∞ would), so the
//! output is a sample of the model's distribution conditioned on staying valid, and the document
//! always parses and satisfies the schema's enforced keywords ([`schema`]).
//!
//! A reasoning model first thinks: while the output is inside its reasoning block the only rule
//! is that it may not end there (its end-of-generation tokens are banned); after the closing tag
//! the document starts (leading whitespace allowed) and, once it is complete, only whitespace
//! and end of generation remain. Masks are cached per matcher state, so the steps inside a long
//! free-text string (the same state again and again) cost nothing after the first.
//!
//! Tool calls ([`Mode::ToolCalls`]) use the same machinery on a different grammar: the answer is
//! free text, and every tool-call block the model opens is held to the tools it may call (their
//! names, their declared parameters, required ones present, values of the declared types) until
//! the block closes, and then only whitespace and the end may follow (the calls end the turn, as
//! the chat template renders them); with `tool_choice` `required` or a named function the
//! answer may not end before one block was written.

pub mod regex;
pub mod matcher;
pub mod schema;
pub mod vocab;

use std::collections::HashMap;
use std::sync::Arc;

use matcher::State;
use schema::Grammar;
use vocab::{Allowed, TokenIndex};

/// Most masks kept per request.
const CACHE: usize = 64;

/// What a request's output must be: shared by the request's copies (retries, `n` choices).
#[derive(Debug)]
pub struct ConstraintSpec {
    /// The compiled schema.
    pub grammar: Grammar,
    /// The vocabulary index the masks are computed over.
    pub index: Arc<TokenIndex>,
    /// The reasoning block's tags (opening, closing), where the model has one.
    pub reasoning: Option<(Vec<u8>, Vec<u8>)>,
    /// Whether the output starts inside the reasoning block (the prompt opened it). Where it
    /// does not, tool-call answers may still open one first, as the output parser reads them.
    pub starts_in_reasoning: bool,
    /// Which part of the answer the grammar holds.
    pub mode: Mode,
}

/// Which part of the answer (after any reasoning) the grammar holds.
#[derive(Debug, Clone, PartialEq)]
pub enum Mode {
    /// All of it: one document.
    Document,
    /// Every tool-call block, from just after its opening tag `open` to its closing tag; the
    /// text around blocks is free. `must_call`: the answer may not end before a block.
    ToolCalls { open: Vec<u8>, must_call: bool },
}

impl PartialEq for ConstraintSpec {
    /// Same schema, same reasoning framing, same vocabulary index.
    fn eq(&self, o: &Self) -> bool {
        self.grammar == o.grammar
            && self.reasoning == o.reasoning
            && self.starts_in_reasoning == o.starts_in_reasoning
            && self.mode == o.mode
            && Arc::ptr_eq(&self.index, &o.index)
    }
}

/// The rule of the next step.
#[derive(Debug, Clone, PartialEq)]
pub enum Rule {
    /// Anything.
    Free,
    /// Anything but ending (inside the reasoning block, or before a required tool call).
    NoEnd,
    /// Only the tokens of this mask.
    Only(Arc<Allowed>),
}

/// Why the output could not be kept valid.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConstraintError {
    #[error("token {0} leaves the structured output's schema (the rank did not apply the mask)")]
    Left(u32),
    #[error("the text after the reasoning block does not start a document of the schema")]
    AfterReasoning,
}

#[derive(Debug)]
enum Phase {
    /// Inside the reasoning block; the bytes of the closing tag seen so far at the end.
    Reasoning(Vec<u8>),
    Document,
    Ended,
    /// Tool calls: free text; the last bytes, where a block's opening tag may be starting.
    Text(Vec<u8>),
    /// Tool calls, at the start of an output that may open its reasoning block: the bytes so
    /// far (whitespace, or the start of the opening tag).
    Opening(Vec<u8>),
    /// Tool calls: inside a block.
    Block,
}

/// The per-request matcher and its mask cache.
#[derive(Debug)]
pub struct Constraint {
    spec: Arc<ConstraintSpec>,
    phase: Phase,
    state: State,
    cache: HashMap<State, Arc<Allowed>>,
    /// Tool-call blocks completed.
    calls: u32,
}

impl Constraint {
    pub fn new(spec: Arc<ConstraintSpec>) -> Self {
        let state = State::start(&spec.grammar);
        let phase = match (&spec.reasoning, spec.starts_in_reasoning, &spec.mode) {
            (Some(_), true, _) => Phase::Reasoning(Vec::new()),
            (_, _, Mode::Document) => Phase::Document,
            (Some(_), false, Mode::ToolCalls { .. }) => Phase::Opening(Vec::new()),
            (None, _, Mode::ToolCalls { .. }) => Phase::Text(Vec::new()),
        };
        Constraint { spec, phase, state, cache: HashMap::new(), calls: 0 }
    }

    /// Whether the next step's rule depends on the token drawn now, so the step may not be
    /// planned with its rule before that token is seen (overlapped decode with late rules
    /// off; with them, every constrained step's rule follows). Free text around tool calls
    /// may be: a block opened by the token in flight is then entered one token late, and a
    /// token that does not fit it leaves that block unconstrained (as without constraints).
    pub fn needs_drawn_token(&self) -> bool {
        match self.spec.mode {
            Mode::Document => true,
            Mode::ToolCalls { .. } => matches!(self.phase, Phase::Block | Phase::Document),
        }
    }

    /// The rule the next sampled token must follow.
    pub fn rule(&mut self) -> Rule {
        match self.phase {
            Phase::Reasoning(_) => Rule::NoEnd,
            Phase::Text(_) | Phase::Opening(_) => match self.spec.mode {
                Mode::ToolCalls { must_call: true, .. } if self.calls == 0 => Rule::NoEnd,
                _ => Rule::Free,
            },
            Phase::Document | Phase::Ended | Phase::Block => {
                if let Some(m) = self.cache.get(&self.state) {
                    return Rule::Only(m.clone());
                }
                let t0 = std::time::Instant::now();
                let index = &self.spec.index;
                let m = Arc::new(Allowed::new(index.allowed(&self.spec.grammar, &self.state), index.vocab()));
                tracing::trace!(us = t0.elapsed().as_micros() as u64, "structured output: token mask computed");
                if self.cache.len() >= CACHE {
                    self.cache.clear();
                }
                self.cache.insert(self.state.clone(), m.clone());
                Rule::Only(m)
            }
        }
    }

    /// The compiled schema.
    pub fn grammar(&self) -> &Grammar {
        &self.spec.grammar
    }

    /// The end-of-generation tokens (banned inside the reasoning block).
    pub fn eog(&self) -> &[u32] {
        self.spec.index.eog()
    }

    /// Moves past a sampled token.
    pub fn advance(&mut self, token: u32) -> Result<(), ConstraintError> {
        let spec = self.spec.clone();
        let bytes = spec.index.token_bytes(token);
        match &mut self.phase {
            Phase::Reasoning(_) => self.reasoning(bytes),
            Phase::Opening(head) => {
                let (open, _) = spec.reasoning.as_ref().expect("an opening phase has tags");
                head.extend_from_slice(bytes);
                let start = head.iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(head.len());
                let t = &head[start..];
                if let Some(rest) = t.strip_prefix(open.as_slice()) {
                    let rest = rest.to_vec();
                    self.phase = Phase::Reasoning(Vec::new());
                    return self.reasoning(&rest);
                }
                if !open.starts_with(t) {
                    // The answer starts without reasoning (as the parser's splitter decides).
                    let all = std::mem::take(head);
                    self.phase = Phase::Text(Vec::new());
                    self.text(&all);
                }
                Ok(())
            }
            Phase::Document => {
                let g = &spec.grammar;
                if spec.index.eog().contains(&token) {
                    if !self.state.can_end(g) {
                        return Err(ConstraintError::Left(token));
                    }
                    self.phase = Phase::Ended;
                    return Ok(());
                }
                // A refused token leaves the state as it was.
                let mut next = self.state.clone();
                if bytes.is_empty() || !next.feed(g, bytes) {
                    if matches!(spec.mode, Mode::ToolCalls { .. }) {
                        // After a tool-call block the mask allows only whitespace and the end;
                        // a token it did not shape (a test replay) leaves the text free.
                        tracing::warn!(token, "structured tool call: text after the block; not constrained further");
                        self.phase = Phase::Text(Vec::new());
                        return Ok(());
                    }
                    return Err(ConstraintError::Left(token));
                }
                self.state = next;
                Ok(())
            }
            Phase::Ended => Ok(()),
            Phase::Text(_) => {
                self.text(bytes);
                Ok(())
            }
            Phase::Block => {
                if bytes.is_empty() {
                    // End of generation (or a control token) inside a block: the mask allows
                    // neither, so only a token drawn before the block was seen gets here.
                    tracing::warn!(token, "structured tool call: the block was left open; not constrained further");
                    self.phase = Phase::Text(Vec::new());
                    return Ok(());
                }
                self.block(bytes);
                Ok(())
            }
        }
    }

    /// Inside the reasoning block: watches for its closing tag, after which the document or
    /// the free text starts.
    fn reasoning(&mut self, bytes: &[u8]) -> Result<(), ConstraintError> {
        let spec = self.spec.clone();
        let (_, close) = spec.reasoning.as_ref().expect("a reasoning phase has tags");
        let Phase::Reasoning(tail) = &mut self.phase else { return Ok(()) };
        tail.extend_from_slice(bytes);
        match find(tail, close) {
            Some(at) => {
                let rest = tail[at + close.len()..].to_vec();
                match &spec.mode {
                    Mode::Document => {
                        self.phase = Phase::Document;
                        if !self.state.feed(&spec.grammar, &rest) {
                            return Err(ConstraintError::AfterReasoning);
                        }
                    }
                    Mode::ToolCalls { .. } => {
                        self.phase = Phase::Text(Vec::new());
                        self.text(&rest);
                    }
                }
            }
            None => keep_tail(tail, close.len()),
        }
        Ok(())
    }

    /// Free text around tool calls: watches for a block's opening tag.
    fn text(&mut self, bytes: &[u8]) {
        let Mode::ToolCalls { open, .. } = &self.spec.mode else { return };
        let open = open.clone();
        let Phase::Text(tail) = &mut self.phase else { return };
        tail.extend_from_slice(bytes);
        match find(tail, &open) {
            Some(at) => {
                let rest = tail[at + open.len()..].to_vec();
                self.phase = Phase::Block;
                self.state = State::start(&self.spec.grammar);
                self.block(&rest);
            }
            None => keep_tail(tail, open.len()),
        }
    }

    /// Inside a tool-call block: bytes up to its end, then free text again. Bytes that do not
    /// fit (only possible for a token drawn before the block was seen) leave the block to the
    /// parser, unconstrained.
    fn block(&mut self, bytes: &[u8]) {
        let g = &self.spec.grammar;
        for (i, &b) in bytes.iter().enumerate() {
            let next = self.state.step(g, b);
            if next.is_dead() {
                tracing::warn!("structured tool call: a token drawn before the block was seen does not fit it; not constrained further");
                self.phase = Phase::Text(Vec::new());
                return;
            }
            self.state = next;
            if self.state.at_end() {
                // The calls end the turn (as the chat template renders them): only whitespace
                // and the end may follow.
                self.calls += 1;
                self.phase = Phase::Document;
                if !self.state.feed(g, &bytes[i + 1..]) {
                    tracing::warn!("structured tool call: text after the block in a token drawn before the block ended; not constrained further");
                    self.phase = Phase::Text(Vec::new());
                }
                return;
            }
        }
    }
}

/// Keeps the last `n - 1` bytes (where a tag of `n` bytes may be starting).
fn keep_tail(tail: &mut Vec<u8>, n: usize) {
    if tail.len() >= n {
        tail.drain(..tail.len() + 1 - n);
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod edge_tests;
#[cfg(test)]
mod walk_tests;
#[cfg(test)]
mod review_tests;
#[cfg(test)]
mod toolcall_params_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const EOG: u32 = 261;

    fn spec(reasoning: bool) -> Arc<ConstraintSpec> {
        let mut items: Vec<(u32, Vec<u8>)> = (0..=255u8).map(|b| (b as u32, vec![b])).collect();
        for (i, t) in ["</think>", "\n\n{", "think>", "think>x"].iter().enumerate() {
            items.push((256 + i as u32, t.as_bytes().to_vec()));
        }
        let index = Arc::new(TokenIndex::from_tokens(262, items, vec![EOG]));
        let grammar = Grammar::from_schema(&json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": false})).unwrap();
        Arc::new(ConstraintSpec { grammar, index, reasoning: Some((b"<think>".to_vec(), b"</think>".to_vec())), starts_in_reasoning: reasoning, mode: Mode::Document })
    }

    fn allowed(c: &mut Constraint, t: u32) -> bool {
        match c.rule() {
            Rule::Free => true,
            Rule::NoEnd => t != EOG,
            Rule::Only(m) => vocab::allows(&m.mask, t),
        }
    }

    #[test]
    fn reasoning_first_then_the_document_then_the_end() {
        let mut c = Constraint::new(spec(true));
        assert_eq!(c.rule(), Rule::NoEnd);
        assert!(!allowed(&mut c, EOG), "no end inside the reasoning");
        // The tag may arrive split over tokens.
        for t in [b'h' as u32, b'<' as u32, b'/' as u32, 258] {
            c.advance(t).unwrap();
        }
        assert!(matches!(c.rule(), Rule::Only(_)));
        assert!(allowed(&mut c, 257) && !allowed(&mut c, b'x' as u32) && !allowed(&mut c, EOG));
        for t in [257u32, b'"' as u32, b'a' as u32, b'"' as u32, b':' as u32, b'7' as u32] {
            assert!(allowed(&mut c, t), "{t}");
            c.advance(t).unwrap();
        }
        assert!(!allowed(&mut c, EOG), "the object is still open");
        c.advance(b'}' as u32).unwrap();
        assert!(allowed(&mut c, EOG) && allowed(&mut c, b'\n' as u32));
        assert_eq!(c.advance(b'x' as u32), Err(ConstraintError::Left(b'x' as u32)));
        c.advance(EOG).unwrap();
    }

    #[test]
    fn a_tag_followed_by_text_that_is_no_document_is_an_error() {
        let mut c = Constraint::new(spec(true));
        for t in [b'<' as u32, b'/' as u32] {
            c.advance(t).unwrap();
        }
        assert_eq!(c.advance(259), Err(ConstraintError::AfterReasoning));
        let mut c = Constraint::new(spec(false));
        assert!(matches!(c.rule(), Rule::Only(_)));
        assert_eq!(c.advance(b'[' as u32), Err(ConstraintError::Left(b'[' as u32)));
        assert_eq!(c.advance(EOG), Err(ConstraintError::Left(EOG)), "no end before the document");
    }
}

#[cfg(test)]
mod tool_mode_tests {
    use super::*;
    use crate::constrain::schema::CallTool;
    use serde_json::json;

    const EOG: u32 = 300;
    const OPEN: u32 = 256;

    /// Bytes as tokens, the block's opening tag as one token (as MiniMax-M2's vocabulary has it).
    fn spec(must_call: bool) -> Arc<ConstraintSpec> {
        let mut items: Vec<(u32, Vec<u8>)> = (0..=255u8).map(|b| (b as u32, vec![b])).collect();
        items.push((OPEN, b"<minimax:tool_call>".to_vec()));
        let index = Arc::new(TokenIndex::from_tokens(301, items, vec![EOG]));
        let params = json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]});
        let grammar = Grammar::tool_calls(&[CallTool { name: "f", parameters: &params }], crate::constrain::matcher::tool_tests::TAGS, 4).unwrap();
        Arc::new(ConstraintSpec { grammar, index, reasoning: Some((b"<think>".to_vec(), b"</think>".to_vec())), starts_in_reasoning: true, mode: Mode::ToolCalls { open: b"<minimax:tool_call>".to_vec(), must_call } })
    }

    fn feed(c: &mut Constraint, text: &str) {
        for b in text.bytes() {
            if let Rule::Only(m) = c.rule() {
                assert!(vocab::allows(&m.mask, b as u32), "{:?} refused", b as char);
            }
            c.advance(b as u32).unwrap();
        }
    }

    #[test]
    fn text_is_free_blocks_are_held_and_a_required_call_comes_before_the_end() {
        let mut c = Constraint::new(spec(true));
        feed(&mut c, "hmm</think>\n\nLet me call it.\n");
        assert_eq!(c.rule(), Rule::NoEnd, "a required call is still to come");
        assert!(!c.needs_drawn_token(), "free text may be decoded overlapped");
        c.advance(OPEN).unwrap();
        assert!(c.needs_drawn_token());
        let Rule::Only(m) = c.rule() else { panic!("inside the block") };
        assert!(!vocab::allows(&m.mask, EOG) && !vocab::allows(&m.mask, b'x' as u32) && vocab::allows(&m.mask, b'<' as u32));
        feed(&mut c, "\n<invoke name=\"f\">\n<parameter name=\"n\">42</parameter>\n</invoke>\n</minimax:tool_call>");
        let Rule::Only(m) = c.rule() else { panic!("after the block: only whitespace and the end") };
        assert!(vocab::allows(&m.mask, EOG) && vocab::allows(&m.mask, b'\n' as u32) && !vocab::allows(&m.mask, b'd' as u32));
        feed(&mut c, "\n");
        c.advance(EOG).unwrap();
        // Without a required call the end is allowed from the start.
        let mut c = Constraint::new(spec(false));
        feed(&mut c, "x</think>ok");
        assert_eq!(c.rule(), Rule::Free);
    }

    #[test]
    fn a_token_drawn_before_the_block_was_seen_that_does_not_fit_leaves_it_free() {
        let mut c = Constraint::new(spec(false));
        feed(&mut c, "</think>");
        c.advance(OPEN).unwrap();
        // Overlapped decode: this token was drawn without the block's mask.
        c.advance(b'Z' as u32).unwrap();
        assert_eq!(c.rule(), Rule::Free);
        // Likewise text after a block that the mask did not shape (a test replay).
        let mut c = Constraint::new(spec(false));
        feed(&mut c, "</think><minimax:tool_call><invoke name=\"f\"><parameter name=\"n\">1</parameter></invoke></minimax:tool_call>");
        assert!(matches!(c.rule(), Rule::Only(_)));
        c.advance(b'Z' as u32).unwrap();
        assert_eq!(c.rule(), Rule::Free);
    }
}
