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

pub mod matcher;
pub mod schema;
pub mod vocab;

use std::collections::HashMap;
use std::sync::Arc;

use matcher::State;
use schema::Grammar;
use vocab::{Mask, TokenIndex};

/// Most masks kept per request.
const CACHE: usize = 64;

/// What a request's output must be: shared by the request's copies (retries, `n` choices).
#[derive(Debug)]
pub struct ConstraintSpec {
    /// The compiled schema.
    pub grammar: Grammar,
    /// The vocabulary index the masks are computed over.
    pub index: Arc<TokenIndex>,
    /// The reasoning block's closing tag when the output starts inside one.
    pub reasoning_close: Option<Vec<u8>>,
}

impl PartialEq for ConstraintSpec {
    /// Same schema, same reasoning framing, same vocabulary index.
    fn eq(&self, o: &Self) -> bool {
        self.grammar == o.grammar && self.reasoning_close == o.reasoning_close && Arc::ptr_eq(&self.index, &o.index)
    }
}

/// The rule of the next step.
#[derive(Debug, Clone, PartialEq)]
pub enum Rule {
    /// Anything but ending (inside the reasoning block).
    NoEnd,
    /// Only the tokens of this mask.
    Only(Arc<Mask>),
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
}

/// The per-request matcher and its mask cache.
#[derive(Debug)]
pub struct Constraint {
    spec: Arc<ConstraintSpec>,
    phase: Phase,
    state: State,
    cache: HashMap<State, Arc<Mask>>,
}

impl Constraint {
    pub fn new(spec: Arc<ConstraintSpec>) -> Self {
        let state = State::start(&spec.grammar);
        let phase = if spec.reasoning_close.is_some() { Phase::Reasoning(Vec::new()) } else { Phase::Document };
        Constraint { spec, phase, state, cache: HashMap::new() }
    }

    /// The rule the next sampled token must follow.
    pub fn rule(&mut self) -> Rule {
        match self.phase {
            Phase::Reasoning(_) => Rule::NoEnd,
            Phase::Document | Phase::Ended => {
                if let Some(m) = self.cache.get(&self.state) {
                    return Rule::Only(m.clone());
                }
                let t0 = std::time::Instant::now();
                let m = Arc::new(self.spec.index.allowed(&self.spec.grammar, &self.state));
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

    /// The vocabulary size masks cover.
    pub fn vocab(&self) -> usize {
        self.spec.index.vocab()
    }

    /// Moves past a sampled token.
    pub fn advance(&mut self, token: u32) -> Result<(), ConstraintError> {
        let g = &self.spec.grammar;
        let bytes = self.spec.index.token_bytes(token);
        match &mut self.phase {
            Phase::Reasoning(tail) => {
                let close = self.spec.reasoning_close.as_deref().expect("a reasoning phase has a tag");
                tail.extend_from_slice(bytes);
                match find(tail, close) {
                    Some(at) => {
                        let rest = tail[at + close.len()..].to_vec();
                        self.phase = Phase::Document;
                        if !self.state.feed(g, &rest) {
                            return Err(ConstraintError::AfterReasoning);
                        }
                    }
                    None if tail.len() > close.len() => {
                        tail.drain(..tail.len() - close.len());
                    }
                    None => {}
                }
                Ok(())
            }
            Phase::Document => {
                if self.spec.index.eog().contains(&token) {
                    if !self.state.can_end(g) {
                        return Err(ConstraintError::Left(token));
                    }
                    self.phase = Phase::Ended;
                    return Ok(());
                }
                // A refused token leaves the state as it was.
                let mut next = self.state.clone();
                if bytes.is_empty() || !next.feed(g, bytes) {
                    return Err(ConstraintError::Left(token));
                }
                self.state = next;
                Ok(())
            }
            Phase::Ended => Ok(()),
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod walk_tests;

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
        Arc::new(ConstraintSpec { grammar, index, reasoning_close: reasoning.then(|| b"</think>".to_vec()) })
    }

    fn allowed(c: &mut Constraint, t: u32) -> bool {
        match c.rule() {
            Rule::NoEnd => t != EOG,
            Rule::Only(m) => vocab::allows(&m, t),
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
