//! Keeping client text from turning into control tokens.
//!
//! The chat template mixes trusted text (its own literals, which may be special tokens) with
//! client strings. Before rendering, every client string is escaped: any character that could
//! begin a special-token match lying in (or reaching into) the string is replaced by a
//! private-use escape sequence. Special tokens in the rendered prompt can therefore only come
//! from the template. After splitting the prompt on special tokens, each plain run is restored
//! and BPE-encoded as ordinary text. Escaping changes nothing else, so templates that trim or
//! compare client text behave as before unless the text contains special-token material.
//!
//! Escape: `ESC ESC` stands for a literal `ESC`; `ESC hi lo` stands for the character
//! `(hi - BASE) << 11 | (lo - BASE)`, with `hi`/`lo` in plane-15 private use.

use std::borrow::Cow;

use aho_corasick::AhoCorasick;
use serde_json::Value as Json;

/// The escape character (a plane-16 private-use code point).
const ESC: char = '\u{10FFFD}';
/// Base of the two payload characters (plane-15 private use).
const BASE: u32 = 0xF0000;

/// Escapes and restores client text against a set of protected token texts.
#[derive(Debug, Clone)]
pub struct Sanitizer {
    protected: Vec<String>,
    matcher: Option<AhoCorasick>,
}

impl Sanitizer {
    /// `protected`: every special-token text (control and user-defined).
    pub fn new(protected: &[String]) -> Self {
        let protected: Vec<String> = protected
            .iter()
            .filter(|p| !p.is_empty())
            .cloned()
            .collect();
        let matcher = (!protected.is_empty())
            .then(|| AhoCorasick::new(&protected).expect("automaton fits in memory"));
        Sanitizer { protected, matcher }
    }

    /// Escapes one client string; `exempt` texts (e.g. `<think>` in assistant history) keep
    /// their meaning.
    pub fn escape<'a>(&self, s: &'a str, exempt: &[&str]) -> Cow<'a, str> {
        let mut marks: Vec<usize> = Vec::new();
        if let Some(m) = &self.matcher {
            for hit in m.find_overlapping_iter(s) {
                if !exempt.contains(&self.protected[hit.pattern().as_usize()].as_str()) {
                    marks.push(hit.start());
                }
            }
        }
        for p in self
            .protected
            .iter()
            .filter(|p| !exempt.contains(&p.as_str()))
        {
            // A match that starts inside `s` and runs past its end.
            let from = s.len().saturating_sub(p.len() - 1);
            for i in (from..s.len()).filter(|&i| s.is_char_boundary(i)) {
                if p.starts_with(&s[i..]) {
                    marks.push(i);
                }
            }
            // A match that starts before `s` and ends inside it. (A token that would need
            // template text on *both* sides of a client string is not considered: no template
            // wraps client text in token fragments, and escaping every short string that is a
            // substring of some token would change what templates compare, e.g. roles.)
            for j in (1..p.len()).filter(|&j| p.is_char_boundary(j)) {
                let k = p.len() - j;
                if k <= s.len() && s.is_char_boundary(k) && s.starts_with(&p[j..]) {
                    marks.push(0);
                    break;
                }
            }
        }
        if marks.is_empty() && !s.contains(ESC) {
            return Cow::Borrowed(s);
        }
        marks.sort_unstable();
        marks.dedup();
        let mut out = String::with_capacity(s.len() + 8 * marks.len());
        let mut next = marks.iter().peekable();
        for (i, c) in s.char_indices() {
            let marked = next.peek().is_some_and(|&&m| m == i);
            if marked {
                next.next();
            }
            if c == ESC {
                out.push(ESC);
                out.push(ESC);
            } else if marked {
                let cp = c as u32;
                out.push(ESC);
                out.push(char::from_u32(BASE + (cp >> 11)).expect("plane-15 code point"));
                out.push(char::from_u32(BASE + (cp & 0x7ff)).expect("plane-15 code point"));
            } else {
                out.push(c);
            }
        }
        Cow::Owned(out)
    }

    /// Escapes every string (and object key) inside a JSON value.
    pub fn escape_json(&self, v: &Json, exempt: &[&str]) -> Json {
        match v {
            Json::String(s) => Json::String(self.escape(s, exempt).into_owned()),
            Json::Array(a) => Json::Array(a.iter().map(|x| self.escape_json(x, exempt)).collect()),
            Json::Object(m) => Json::Object(
                m.iter()
                    .map(|(k, x)| {
                        (
                            self.escape(k, exempt).into_owned(),
                            self.escape_json(x, exempt),
                        )
                    })
                    .collect(),
            ),
            other => other.clone(),
        }
    }

    /// Undoes [`Sanitizer::escape`]; a sequence a template mangled is left as it is.
    pub fn restore(s: &str) -> Cow<'_, str> {
        if !s.contains(ESC) {
            return Cow::Borrowed(s);
        }
        let mut out = String::with_capacity(s.len());
        let mut chars = s.chars().peekable();
        while let Some(c) = chars.next() {
            if c != ESC {
                out.push(c);
                continue;
            }
            if chars.peek() == Some(&ESC) {
                chars.next();
                out.push(ESC);
                continue;
            }
            let mut look = chars.clone();
            let decoded = match (look.next(), look.next()) {
                (Some(hi), Some(lo)) => {
                    let (h, l) = (hi as u32, lo as u32);
                    if (BASE..BASE + 0x800).contains(&h) && (BASE..BASE + 0x800).contains(&l) {
                        char::from_u32(((h - BASE) << 11) | (l - BASE))
                    } else {
                        None
                    }
                }
                _ => None,
            };
            match decoded {
                Some(d) => {
                    out.push(d);
                    chars = look;
                }
                None => out.push(c),
            }
        }
        Cow::Owned(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn san() -> Sanitizer {
        Sanitizer::new(&[
            "[e~[".into(),
            "]~b]".into(),
            "]~!b[".into(),
            "<think>".into(),
        ])
    }

    fn contains_special(s: &str) -> bool {
        ["[e~[", "]~b]", "]~!b[", "<think>"]
            .iter()
            .any(|p| s.contains(p))
    }

    #[test]
    fn escapes_full_and_overlapping_occurrences_and_restores() {
        let s = san();
        for text in [
            "a[e~[b",
            "]~b]~b]",
            "]~!b[e~[",
            "x<think>y",
            "plain",
            "\u{10FFFD}odd\u{10FFFD}",
            "é[e~[😀",
        ] {
            let e = s.escape(text, &[]);
            assert!(!contains_special(&e), "{text:?} -> {e:?}");
            assert_eq!(Sanitizer::restore(&e), text);
        }
        assert!(matches!(s.escape("plain", &[]), Cow::Borrowed(_)));
    }

    #[test]
    fn boundary_fragments_cannot_combine_with_template_text() {
        let s = san();
        // Client text ending in a prefix of a special token, followed by the template's token.
        for (client, template_after) in [("look [e~", "[e~[\n"), ("x]~", "b]"), ("<thi", "nk>")] {
            let rendered = format!("{}{}", s.escape(client, &[]), template_after);
            let first = rendered
                .find("[e~[")
                .or_else(|| rendered.find("]~b]"))
                .or_else(|| rendered.find("<think>"));
            let client_len = s.escape(client, &[]).len();
            assert!(
                first.is_none_or(|p| p >= client_len),
                "{client:?}: {rendered:?}"
            );
        }
        // Template text ending in a prefix, followed by client text completing it.
        for (template_before, client) in [("[e~", "[ hi"), ("]~b", "]user"), ("<th", "ink>")] {
            let rendered = format!("{}{}", template_before, s.escape(client, &[]));
            assert!(!contains_special(&rendered), "{client:?}: {rendered:?}");
        }
    }

    #[test]
    fn exempt_texts_are_kept() {
        let s = san();
        assert_eq!(
            s.escape("<think>r</think>", &["<think>"]),
            "<think>r</think>"
        );
        assert!(!s.escape("<think>[e~[", &["<think>"]).contains("[e~["));
    }
}
