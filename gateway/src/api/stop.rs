//! Stop strings: matched on the decoded text stream even when split across tokens; the matched
//! string and everything after it are never returned.

/// Streaming stop-string matcher for one choice.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    /// The stop string that matched, once one did (the Anthropic API reports it).
    matched: Option<String>,
}

/// What one push released.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopOutput {
    /// Text that is certainly output.
    pub text: String,
    /// A stop string matched: generation must end; nothing after it is returned.
    pub stopped: bool,
}

impl StopMatcher {
    /// Empty strings are ignored.
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new(), matched: None }
    }

    pub fn is_active(&self) -> bool {
        !self.stops.is_empty()
    }

    pub fn stopped(&self) -> bool {
        self.matched.is_some()
    }

    /// The stop string that ended the text, once one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Feeds decoded text. Text that might be the start of a stop string is held back.
    pub fn push(&mut self, text: &str) -> StopOutput {
        if self.stopped() {
            return StopOutput { text: String::new(), stopped: true };
        }
        if self.stops.is_empty() {
            return StopOutput { text: text.to_string(), stopped: false };
        }
        self.held.push_str(text);
        // Earliest complete match wins (ties: the longer string was written first anyway).
        let first = self.stops.iter().filter_map(|s| self.held.find(s.as_str()).map(|p| (p, s))).min_by_key(|m| m.0);
        if let Some((pos, s)) = first {
            self.matched = Some(s.clone());
            let out = self.held[..pos].to_string();
            self.held.clear();
            return StopOutput { text: out, stopped: true };
        }
        let hold = self.longest_partial();
        let cut = self.held.len() - hold;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopOutput { text: out, stopped: false }
    }

    /// End of stream without a match: held-back text is output after all.
    pub fn finish(&mut self) -> String {
        if self.stopped() {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }

    /// Length in bytes of the longest suffix of `held` that is a proper prefix of a stop string,
    /// on a char boundary.
    fn longest_partial(&self) -> usize {
        let mut best = 0;
        for s in &self.stops {
            let max = s.len().saturating_sub(1).min(self.held.len());
            for len in (best + 1..=max).rev() {
                let start = self.held.len() - len;
                if self.held.is_char_boundary(start) && s.starts_with(&self.held[start..]) {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], chunks: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for c in chunks {
            let o = m.push(c);
            out.push_str(&o.text);
            if o.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn every_split_point() {
        let text = "hello wörld END tail";
        for i in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            for j in (i..=text.len()).filter(|&j| text.is_char_boundary(j)) {
                let got = run(&["END"], &[&text[..i], &text[i..j], &text[j..]]);
                assert_eq!(got, ("hello wörld ".to_string(), true), "split {i} {j}");
            }
        }
    }

    #[test]
    fn the_matched_string_is_the_earliest_one() {
        let mut m = StopMatcher::new(vec!["c d".into(), "b c".into()]);
        assert_eq!(m.matched(), None);
        assert!(!m.push("a b").stopped);
        assert!(m.push(" c d").stopped);
        assert_eq!(m.matched(), Some("b c"));
        let mut m = StopMatcher::new(vec!["zz".into()]);
        m.push("abc");
        m.finish();
        assert_eq!(m.matched(), None);
    }

    #[test]
    fn partial_match_released_at_end() {
        assert_eq!(run(&["END"], &["abc E", "N"]), ("abc EN".into(), false));
        assert_eq!(run(&["xyz"], &["abc"]), ("abc".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn earliest_of_several_and_multibyte() {
        assert_eq!(run(&["b c", "c d"], &["a b", " c d"]), ("a ".into(), true));
        assert_eq!(run(&["é!"], &["caf", "é", "!x"]), ("caf".into(), true));
        assert_eq!(run(&["\n\n"], &["line\n", "\nmore"]), ("line".into(), true));
    }

    #[test]
    fn held_text_is_released_once_it_cannot_match() {
        let mut m = StopMatcher::new(vec!["STOP".into()]);
        assert_eq!(m.push("aST").text, "a");
        assert_eq!(m.push("x").text, "STx");
    }
}
