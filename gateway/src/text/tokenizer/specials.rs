//! Finding special-token texts inside trusted text (chat-template output).

use aho_corasick::{AhoCorasick, MatchKind};

/// A piece of trusted text: ordinary text for BPE, or one special token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece<'a> {
    /// Text between special tokens.
    Text(&'a str),
    /// A special token id.
    Special(u32),
}

/// Matcher over every control and user-defined token text, leftmost-longest like HF's
/// added-token splitting.
#[derive(Debug, Clone)]
pub struct SpecialTokens {
    matcher: Option<AhoCorasick>,
    ids: Vec<u32>,
    texts: Vec<String>,
}

impl SpecialTokens {
    /// Builds the matcher; the first id wins when two tokens share a text.
    pub fn new(mut entries: Vec<(String, u32)>) -> Self {
        entries.retain(|(t, _)| !t.is_empty());
        let mut seen = std::collections::HashSet::new();
        entries.retain(|(t, _)| seen.insert(t.clone()));
        let texts: Vec<String> = entries.iter().map(|(t, _)| t.clone()).collect();
        let ids = entries.iter().map(|(_, id)| *id).collect();
        let matcher = if texts.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(&texts)
                    .expect("special-token automaton fits in memory"),
            )
        };
        SpecialTokens {
            matcher,
            ids,
            texts,
        }
    }

    /// All special texts, for the sanitizer.
    pub fn texts(&self) -> &[String] {
        &self.texts
    }

    /// The id of an exact special text.
    pub fn id_of(&self, text: &str) -> Option<u32> {
        self.texts
            .iter()
            .position(|t| t == text)
            .map(|i| self.ids[i])
    }

    /// Splits trusted text into ordinary runs and special tokens.
    pub fn split<'a>(&self, text: &'a str) -> Vec<Piece<'a>> {
        let mut out = Vec::new();
        let mut last = 0;
        if let Some(m) = &self.matcher {
            for hit in m.find_iter(text) {
                if hit.start() > last {
                    out.push(Piece::Text(&text[last..hit.start()]));
                }
                out.push(Piece::Special(self.ids[hit.pattern().as_usize()]));
                last = hit.end();
            }
        }
        if last < text.len() {
            out.push(Piece::Text(&text[last..]));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_leftmost_longest() {
        let s = SpecialTokens::new(vec![
            ("<a>".into(), 7),
            ("<a><b>".into(), 8),
            ("[e~[".into(), 9),
        ]);
        assert_eq!(
            s.split("x<a><b>y<a>[e~["),
            vec![
                Piece::Text("x"),
                Piece::Special(8),
                Piece::Text("y"),
                Piece::Special(7),
                Piece::Special(9)
            ]
        );
        assert_eq!(s.split(""), vec![]);
        assert_eq!(s.id_of("[e~["), Some(9));
    }
}
