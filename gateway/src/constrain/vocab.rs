//! The vocabulary as the matcher sees it: every ordinary token's bytes, sorted, so the tokens a
//! matcher state allows are found in one walk that shares the work of common prefixes (a trie
//! walk without building the trie) and skips every token under a prefix the state refuses.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::matcher::{PSub, PatStep, State, StrRun, StrSub, raw_run, str_run};
use super::schema::Grammar;
use crate::text::tokenizer::{TokenType, Tokenizer};

/// One bit per token id (bit `t % 64` of word `t / 64`), set when the token is allowed.
pub type Mask = Vec<u64>;

/// Most banned tokens a mask is sent as (as `logit_bias` entries) instead of as a mask (and at
/// most an eighth of the vocabulary: a mask's size).
pub const MAX_BANS: usize = 4096;

/// A mask and the form it travels to the head rank in, both made once per matcher state.
#[derive(Debug, Clone, PartialEq)]
pub struct Allowed {
    pub mask: Mask,
    pub wire: Wire,
}

/// How a mask crosses gRPC.
#[derive(Debug, Clone, PartialEq)]
pub enum Wire {
    /// The few tokens it bans, ascending: sent as `logit_bias` −∞ (the same reduction), which a
    /// CUDA rank does on the device.
    Bans(Vec<u32>),
    /// `SamplingSpec.allowed_tokens`: bit `t % 8` of byte `t / 8`.
    Bits(Vec<u8>),
}

impl Allowed {
    /// `mask` over a vocabulary of `vocab` tokens, with its wire form.
    pub fn new(mask: Mask, vocab: usize) -> Self {
        let allowed: usize = mask.iter().map(|w| w.count_ones() as usize).sum();
        let wire = if vocab - allowed.min(vocab) <= MAX_BANS.min(vocab / 8) {
            Wire::Bans((0..vocab as u32).filter(|&t| !allows(&mask, t)).collect())
        } else {
            let mut bytes: Vec<u8> = mask.iter().flat_map(|w| w.to_le_bytes()).collect();
            bytes.truncate(vocab.div_ceil(8));
            Wire::Bits(bytes)
        };
        Allowed { mask, wire }
    }
}

/// The vocabulary's ordinary tokens in byte order, with their common-prefix lengths.
#[derive(Debug)]
pub struct TokenIndex {
    vocab: usize,
    /// Every token's bytes, by id (special tokens too: the reasoning block's tag is one).
    all: Vec<Box<[u8]>>,
    /// The ordinary token ids, sorted by their bytes.
    ids: Vec<u32>,
    /// Their bytes back to back in that order (`off[i]..off[i + 1]`), so every walk over the
    /// vocabulary reads memory in order: 200k boxes read in sorted order cost ~35 ms in cache
    /// misses alone.
    sorted: Vec<u8>,
    off: Vec<u32>,
    /// `lcp[i]`: bytes `bytes[i]` shares with `bytes[i - 1]` (0 for the first).
    lcp: Vec<u16>,
    /// End-of-generation ids (allowed where the document may end).
    eog: Vec<u32>,
    /// Per string sub-state: what every ordinary token (in `ids` order) does inside a string,
    /// computed once on first use.
    strings: Mutex<HashMap<StrSub, Arc<Vec<StrRun>>>>,
    /// Per raw-text closing tag and bytes of it matched: where every ordinary token completes
    /// the tag (`u16::MAX`: it does not), computed once on first use.
    raws: Mutex<HashMap<RawKey, Arc<Vec<u16>>>>,
}

/// A raw-text closing tag and how many of its bytes were matched.
type RawKey = (Vec<u8>, u32);

impl TokenIndex {
    /// Indexes a tokenizer's ordinary tokens (control, user-defined, unused and unknown tokens
    /// never belong to a constrained document).
    pub fn new(tok: &Tokenizer) -> Self {
        let v = tok.vocab_size() as u32;
        let all = (0..v).map(|id| tok.token_bytes(id).to_vec().into_boxed_slice()).collect();
        let ordinary = (0..v).filter(|&id| matches!(tok.token_type(id), TokenType::Normal | TokenType::Byte) && !tok.is_eog(id)).collect();
        Self::build(all, ordinary, tok.eog_ids())
    }

    /// Indexes explicit `(id, bytes)` pairs, all ordinary, in a vocabulary of `vocab` ids
    /// (tests and benchmarks).
    pub fn from_tokens(vocab: usize, items: Vec<(u32, Vec<u8>)>, eog: Vec<u32>) -> Self {
        let mut all: Vec<Box<[u8]>> = vec![Box::default(); vocab];
        let ids = items.iter().map(|(i, _)| *i).collect();
        for (i, b) in items {
            all[i as usize] = b.into_boxed_slice();
        }
        Self::build(all, ids, eog)
    }

    fn build(all: Vec<Box<[u8]>>, mut ids: Vec<u32>, eog: Vec<u32>) -> Self {
        ids.retain(|&i| !all[i as usize].is_empty());
        ids.sort_by(|&a, &b| all[a as usize].cmp(&all[b as usize]).then(a.cmp(&b)));
        let mut lcp = Vec::with_capacity(ids.len());
        for i in 0..ids.len() {
            let l = if i == 0 { 0 } else { all[ids[i] as usize].iter().zip(&*all[ids[i - 1] as usize]).take_while(|(a, b)| a == b).count() };
            lcp.push(l.min(u16::MAX as usize) as u16);
        }
        let mut sorted = Vec::new();
        let mut off = vec![0u32];
        for &id in &ids {
            sorted.extend_from_slice(&all[id as usize]);
            off.push(sorted.len() as u32);
        }
        TokenIndex { vocab: all.len(), all, ids, sorted, off, lcp, eog, strings: Mutex::new(HashMap::new()), raws: Mutex::new(HashMap::new()) }
    }

    /// The bytes of the `i`-th ordinary token in byte order.
    fn nth(&self, i: usize) -> &[u8] {
        &self.sorted[self.off[i] as usize..self.off[i + 1] as usize]
    }

    /// The bytes token `id` stands for (empty outside the vocabulary).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.all.get(id as usize).map_or(&[], |b| b)
    }

    /// The vocabulary size masks cover.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The end-of-generation ids.
    pub fn eog(&self) -> &[u32] {
        &self.eog
    }

    /// What every ordinary token does inside a string from `sub`.
    fn string_runs(&self, sub: StrSub) -> Arc<Vec<StrRun>> {
        let mut cache = self.strings.lock().expect("the string-run cache lock");
        cache.entry(sub).or_insert_with(|| Arc::new((0..self.ids.len()).map(|i| str_run(sub, self.nth(i))).collect())).clone()
    }

    /// Where every ordinary token completes raw text's closing `tag` from `k` matched bytes.
    fn raw_runs(&self, tag: &[u8], k: u32) -> Arc<Vec<u16>> {
        let mut cache = self.raws.lock().expect("the raw-run cache lock");
        cache
            .entry((tag.to_vec(), k))
            .or_insert_with(|| {
                Arc::new((0..self.ids.len()).map(|i| raw_run(tag, k as usize, self.nth(i)).map_or(u16::MAX, |e| e.min(u16::MAX as usize - 1) as u16)).collect())
            })
            .clone()
    }

    /// The first token after `i` that does not start with token `i`'s first `d + 1` bytes
    /// (those die where token `i` died, at byte `d`).
    fn past_prefix(&self, mut i: usize, d: usize) -> usize {
        i += 1;
        while i < self.ids.len() && self.lcp[i] as usize > d {
            i += 1;
        }
        i
    }

    /// The tokens whose bytes keep `state` alive, plus the end-of-generation tokens when the
    /// document may end in `state`.
    pub fn allowed(&self, g: &Grammar, state: &State) -> Mask {
        let mut mask = vec![0u64; self.vocab.div_ceil(64)];
        let set = |m: &mut Mask, t: u32| m[(t / 64) as usize] |= 1 << (t % 64);
        if let Some(view) = state.in_string() {
            // Inside a string value (most of a document's tokens): the tokens that stay inside
            // are known per sub-state; only those that close it are run on past the quote.
            let runs = self.string_runs(view.sub);
            let after = view.after_close(g);
            for (i, run) in runs.iter().enumerate() {
                if !view.admits(run) {
                    continue;
                }
                let id = self.ids[i];
                let ok = match *run {
                    StrRun::Closes { at, .. } => after.as_ref().is_some_and(|a| {
                        let mut a = a.clone();
                        a.feed(g, &self.nth(i)[at as usize + 1..])
                    }),
                    _ => true,
                };
                if ok {
                    set(&mut mask, id);
                }
            }
            return mask;
        }
        if let Some(view) = state.in_pattern(g) {
            // Inside a patterned string: the bytes up to the closing quote step the automaton
            // only (shared across tokens by their common prefix, as the general walk below);
            // a token that closes the string runs on from the state after it.
            let mut stack: Vec<(u32, PSub)> = vec![(view.ds, view.sub)];
            let mut i = 0;
            while i < self.ids.len() {
                let b = self.nth(i);
                let keep = (self.lcp[i] as usize).min(stack.len() - 1);
                stack.truncate(keep + 1);
                let mut dead_at = None;
                let mut ok = true;
                for (d, &byte) in b.iter().enumerate().skip(keep) {
                    let (ds, sub) = stack[d];
                    match view.step(g, ds, sub, byte) {
                        PatStep::In(ds, sub) => stack.push((ds, sub)),
                        PatStep::Close => {
                            ok = view.after.as_ref().is_some_and(|a| {
                                let mut a = a.clone();
                                a.feed(g, &b[d + 1..])
                            });
                            break;
                        }
                        PatStep::Dead => {
                            dead_at = Some(d);
                            break;
                        }
                    }
                }
                match dead_at {
                    None => {
                        if ok {
                            set(&mut mask, self.ids[i]);
                        }
                        i += 1;
                    }
                    Some(d) => i = self.past_prefix(i, d),
                }
            }
            return mask;
        }
        if let Some(view) = state.in_raw_pattern(g) {
            // Inside a patterned string parameter's raw text: the bytes step the automaton
            // only (shared across tokens by their common prefix); where the text may end, a
            // token may also run on from the state after it (the closing tag), which takes
            // few first bytes: only those are tried there.
            let first: Vec<bool> = (0..=255u8).map(|b| view.after.as_ref().is_some_and(|a| !a.step(g, b).is_dead())).collect();
            let mut stack: Vec<(u32, PSub)> = vec![(view.ds, view.sub)];
            let mut i = 0;
            while i < self.ids.len() {
                let b = self.nth(i);
                let keep = (self.lcp[i] as usize).min(stack.len() - 1);
                stack.truncate(keep + 1);
                // Whether the text may end before some byte so far that the state after it
                // takes (then tokens sharing the prefix differ in whether they run on).
                let exit_at = |d: usize, stack: &[(u32, PSub)]| view.may_end(g, stack[d].0, stack[d].1) && first[b[d] as usize];
                let mut ok = false;
                let mut dead_at = None;
                let mut exits = false;
                for d in 0..b.len() {
                    if exit_at(d, &stack) {
                        exits = true;
                        if view.after.as_ref().is_some_and(|a| a.clone().feed(g, &b[d..])) {
                            ok = true;
                            break;
                        }
                    }
                    if d < keep {
                        continue;
                    }
                    let (ds, sub) = stack[d];
                    match view.step_raw(g, ds, sub, b[d]) {
                        Some(next) => stack.push(next),
                        None => {
                            dead_at = Some(d);
                            break;
                        }
                    }
                }
                if ok || dead_at.is_none() {
                    set(&mut mask, self.ids[i]);
                }
                i = match dead_at {
                    Some(d) if !ok && !exits => self.past_prefix(i, d),
                    _ => i + 1,
                };
            }
            return mask;
        }
        if let Some(key) = state.in_free_key() {
            // Inside an object key where other keys are allowed: nearly every token fits, and
            // a loop over a token's bytes says which, without stepping states.
            for (i, &id) in self.ids.iter().enumerate() {
                if key.admits(g, self.nth(i)) {
                    set(&mut mask, id);
                }
            }
            return mask;
        }
        if let Some((close, k, after)) = state.in_raw(g) {
            // Inside raw text: every token that does not complete the closing tag; those that
            // do run on past it.
            let runs = self.raw_runs(&g.texts[close as usize], k);
            for (i, &end) in runs.iter().enumerate() {
                let id = self.ids[i];
                let ok = end == u16::MAX
                    || after.as_ref().is_some_and(|a| {
                        let mut a = a.clone();
                        a.feed(g, &self.nth(i)[end as usize..])
                    });
                if ok {
                    set(&mut mask, id);
                }
            }
            return mask;
        }
        if state.can_end(g) {
            for &t in &self.eog {
                set(&mut mask, t);
            }
        }
        // stack[d]: the state after the first d bytes of the token last walked.
        let mut stack: Vec<State> = vec![state.clone()];
        let mut i = 0;
        while i < self.ids.len() {
            let b = self.nth(i);
            let keep = (self.lcp[i] as usize).min(stack.len() - 1);
            stack.truncate(keep + 1);
            let mut dead_at = None;
            for (d, &byte) in b.iter().enumerate().skip(keep) {
                let next = stack[d].step(g, byte);
                if next.is_dead() {
                    dead_at = Some(d);
                    break;
                }
                stack.push(next);
            }
            match dead_at {
                None => {
                    set(&mut mask, self.ids[i]);
                    i += 1;
                }
                Some(d) => i = self.past_prefix(i, d),
            }
        }
        mask
    }
}

/// Whether `t` is set in `m`.
pub fn allows(m: &Mask, t: u32) -> bool {
    m.get((t / 64) as usize).is_some_and(|w| w >> (t % 64) & 1 == 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A small vocabulary: every byte alone plus some merges.
    fn index() -> TokenIndex {
        let mut items: Vec<(u32, Vec<u8>)> = (0..=255u8).map(|b| (b as u32, vec![b])).collect();
        for (i, t) in ["{\"", "\":", "true", "false", "null", "\"}", "  ", "ab", "abc", "\",\"", "}\n", "12", "1.", "é"].iter().enumerate() {
            items.push((256 + i as u32, t.as_bytes().to_vec()));
        }
        TokenIndex::from_tokens(300, items, vec![299])
    }

    /// The same answer as stepping every token on its own.
    pub(super) fn brute(idx: &TokenIndex, g: &Grammar, s: &State) -> Mask {
        let mut m = vec![0u64; idx.vocab.div_ceil(64)];
        for id in &idx.ids {
            let mut st = s.clone();
            if st.feed(g, idx.token_bytes(*id)) {
                m[(*id / 64) as usize] |= 1 << (id % 64);
            }
        }
        if s.can_end(g) {
            for &t in &idx.eog {
                m[(t / 64) as usize] |= 1 << (t % 64);
            }
        }
        m
    }

    #[test]
    fn the_walk_allows_exactly_the_tokens_that_fit() {
        let idx = index();
        let g = Grammar::from_schema(&json!({"type": "object", "properties": {"ab": {"type": "boolean"}, "n": {"type": "number"}}, "required": ["ab"], "additionalProperties": false})).unwrap();
        let mut s = State::start(&g);
        for prefix in ["", "{", "{\"", "{\"a", "{\"ab\":", "{\"ab\": t", "{\"ab\": true", "{\"ab\": true,\"n\":1", "{\"ab\": true,\"n\":1}"] {
            let mut st = s.clone();
            assert!(st.feed(&g, prefix.as_bytes()), "{prefix}");
            let m = idx.allowed(&g, &st);
            assert_eq!(m, brute(&idx, &g, &st), "after {prefix:?}");
            assert!(m.iter().any(|w| *w != 0), "something is always allowed after {prefix:?}");
        }
        assert!(s.feed(&g, b"{\"ab\":false}"));
        let m = idx.allowed(&g, &s);
        assert!(allows(&m, 299), "end of generation once the document is complete");
        assert!(allows(&m, b' ' as u32) && !allows(&m, b'x' as u32));
        let m = idx.allowed(&g, &State::start(&g));
        assert!(!allows(&m, 299) && allows(&m, 256) && !allows(&m, 258), "`{{\"` may start it, `true` may not");
    }

    #[test]
    fn inside_strings_the_fast_path_is_the_walk() {
        // Tokens that close strings, escape, and split multi-byte characters.
        let mut items: Vec<(u32, Vec<u8>)> = (0..=255u8).map(|b| (b as u32, vec![b])).collect();
        let extra: [&[u8]; 14] = [b"a\"", b"\"]", b"\\u00", b"\\n", "é".as_bytes(), b"\xc3", b"\xa9x", b"\",\"", b"\"}", b"ab\"}", b"\"],", b"xyz", b"\"\"", "\u{20ac}\"".as_bytes()];
        for (i, t) in extra.iter().enumerate() {
            items.push((256 + i as u32, t.to_vec()));
        }
        let idx = TokenIndex::from_tokens(300, items, vec![299]);
        let g = Grammar::from_schema(&json!({"type": "object", "properties": {
            "s": {"type": "array", "items": {"type": "string"}},
            "b": {"type": "string", "minLength": 2, "maxLength": 4}
        }, "additionalProperties": false})).unwrap();
        for prefix in [
            &b"{\"s\":[\""[..], b"{\"s\":[\"ab", b"{\"s\":[\"a\\", b"{\"s\":[\"a\\u0", b"{\"s\":[\"\xc3", b"{\"s\":[\"\xe2\x82",
            b"{\"b\":\"", b"{\"b\":\"a", b"{\"b\":\"ab", b"{\"b\":\"abc", b"{\"b\":\"abcd", b"{\"b\":\"abc\xc3", b"{\"b\":\"a\\",
            b"{\"b\":\"ab\",\"s\":[\"", b"{\"s\":[\"x\",\"",
        ] {
            let mut st = State::start(&g);
            assert!(st.feed(&g, prefix), "{}", String::from_utf8_lossy(prefix));
            assert!(st.in_string().is_some(), "{}", String::from_utf8_lossy(prefix));
            assert_eq!(idx.allowed(&g, &st), brute(&idx, &g, &st), "after {}", String::from_utf8_lossy(prefix));
        }
    }
}

#[cfg(test)]
mod pattern_tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn inside_a_patterned_string_the_fast_path_is_the_walk() {
        let mut items: Vec<(u32, Vec<u8>)> = (0..=255u8).map(|b| (b as u32, vec![b])).collect();
        let extra: [&[u8]; 12] = [b"ab", b"abc", b"\"}", b"\",\"", b"\\u00", b"\\u0061", b"\xc3\xa9", b"\xc3", b"\"", b"12", b"\\n", b"a\"]"];
        for (i, t) in extra.iter().enumerate() {
            items.push((256 + i as u32, t.to_vec()));
        }
        let idx = TokenIndex::from_tokens(300, items, vec![299]);
        let g = Grammar::from_schema(&json!({"type": "object", "properties": {
            "p": {"type": "string", "pattern": "^[a-cé]{1,4}$"},
            "d": {"type": "string", "format": "date"},
            "q": {"type": "array", "items": {"type": "string", "pattern": "a"}}
        }, "additionalProperties": false})).unwrap();
        for prefix in [
            &b"{\"p\":\""[..], b"{\"p\":\"ab", b"{\"p\":\"abcc", b"{\"p\":\"a\\", b"{\"p\":\"a\\u00", b"{\"p\":\"\xc3",
            b"{\"d\":\"2024-", b"{\"d\":\"2024-02-2", b"{\"q\":[\"", b"{\"q\":[\"xa", b"{\"q\":[\"a\",\"b",
        ] {
            let mut st = State::start(&g);
            assert!(st.feed(&g, prefix), "{}", String::from_utf8_lossy(prefix));
            assert!(st.in_pattern(&g).is_some(), "{}", String::from_utf8_lossy(prefix));
            let m = idx.allowed(&g, &st);
            assert_eq!(m, super::tests::brute(&idx, &g, &st), "after {}", String::from_utf8_lossy(prefix));
            assert!(m.iter().any(|w| *w != 0), "a way on after {}", String::from_utf8_lossy(prefix));
        }
    }
}

#[cfg(test)]
mod raw_tests {
    use super::*;
    use crate::constrain::schema::CallTool;
    use serde_json::json;

    /// Every byte as a token, then `extra` (ids from 256), in a vocabulary of 300 whose last id
    /// ends generation.
    fn bytes_and(extra: &[&[u8]]) -> TokenIndex {
        let mut items: Vec<(u32, Vec<u8>)> = (0..=255u8).map(|b| (b as u32, vec![b])).collect();
        for (i, t) in extra.iter().enumerate() {
            items.push((256 + i as u32, t.to_vec()));
        }
        TokenIndex::from_tokens(300, items, vec![299])
    }

    #[test]
    fn inside_raw_text_the_fast_path_is_the_walk() {
        let idx = bytes_and(&[b"<</parameter>x", b"</parameter>", b"</param", b"eter>\n<", b"x</parameter>x", b"</parameter><parameter name=\"", b"<</", b"a<", b"</parameter></invoke>", b">"]);
        let params = json!({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}, "required": ["a"]});
        let g = Grammar::tool_calls(&[CallTool { name: "f", parameters: &params }], crate::constrain::matcher::tool_tests::TAGS, 2).unwrap();
        for prefix in ["<invoke name=\"f\"><parameter name=\"a\">", "<invoke name=\"f\"><parameter name=\"a\">x<", "<invoke name=\"f\"><parameter name=\"a\">x</param", "<invoke name=\"f\"><parameter name=\"b\">"] {
            let mut st = State::start(&g);
            assert!(st.feed(&g, prefix.as_bytes()), "{prefix}");
            assert!(st.in_raw(&g).is_some(), "{prefix}");
            assert_eq!(idx.allowed(&g, &st), super::tests::brute(&idx, &g, &st), "after {prefix}");
        }
    }

    /// Inside a patterned string parameter (raw text held to its automaton, no `<`): the
    /// masks are what stepping every token alone gives, tokens that end the value and run into
    /// the closing tag included, and some token always goes on.
    #[test]
    fn inside_a_patterned_string_parameter_the_masks_are_the_walk() {
        let idx = bytes_and(&[b"ab", b"AB-", b"-12", b"1</parameter>", b"12</param", b"</parameter>", b"\xc3\xa9", b"\xc3", b"2024-", b"9</parameter></invoke>"]);
        let params = json!({"type": "object", "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{1,3}$"},
            "day": {"type": "string", "format": "date"},
            "name": {"type": "string", "pattern": "^[a-zé]+$", "maxLength": 4}
        }});
        let g = Grammar::tool_calls(&[CallTool { name: "f", parameters: &params }], crate::constrain::matcher::tool_tests::TAGS, 2).unwrap();
        let open = |p: &str, v: &str| format!("<invoke name=\"f\"><parameter name=\"{p}\">{v}");
        for prefix in [open("code", ""), open("code", "AB-"), open("code", "AB-12"), open("code", "AB-123"), open("day", "2024-0"), open("name", ""), open("name", "ab"), open("name", "abé")] {
            let mut st = State::start(&g);
            assert!(st.feed(&g, prefix.as_bytes()), "{prefix}");
            // (The fast path inside the text; before its first byte, the general walk.)
            assert_eq!(st.in_raw_pattern(&g).is_some(), !prefix.ends_with('>'), "{prefix}");
            let m = idx.allowed(&g, &st);
            assert_eq!(m, super::tests::brute(&idx, &g, &st), "after {prefix}");
            assert!(m.iter().any(|w| *w != 0), "a way on after {prefix}");
        }
    }
}

#[cfg(test)]
mod key_tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn inside_free_keys_the_fast_path_is_the_walk() {
        let mut items: Vec<(u32, Vec<u8>)> = (0..=255u8).map(|b| (b as u32, vec![b])).collect();
        let extra: [&[u8]; 12] = [b"ab", b"abc\"", b"\":", b"\": 1", b"\":\"x", b"a\\\"b\"", b"\\u0061", b"q\\", b"\"}", b"b\": tr", "é\"".as_bytes(), b"\\n\""];
        for (i, t) in extra.iter().enumerate() {
            items.push((256 + i as u32, t.to_vec()));
        }
        let idx = TokenIndex::from_tokens(300, items, vec![299]);
        let g = Grammar::from_schema(&json!({"properties": {"ab": {"type": "integer"}, "a\"b": {"type": "boolean"}, "abc": {"type": "null"}},
                                              "additionalProperties": {"type": "string"}})).unwrap();
        for prefix in ["{\"", "{\"a", "{\"ab", "{\"a\\", "{\"x", "{\"ab\":1,\"", "{\"ab\":1,\"a", "{\"é"] {
            let mut st = State::start(&g);
            assert!(st.feed(&g, prefix.as_bytes()), "{prefix}");
            assert!(st.in_free_key().is_some(), "{prefix}");
            assert_eq!(idx.allowed(&g, &st), super::tests::brute(&idx, &g, &st), "after {prefix}");
        }
    }
}

#[cfg(test)]
mod wire_tests {
    use super::*;

    #[test]
    fn few_bans_travel_as_bans_others_as_bits() {
        // 100 tokens: banning 12 (an eighth) or fewer goes as bans, more as the bit mask.
        let mask_without = |banned: &[u32]| {
            let mut m = vec![0u64; 2];
            for t in (0..100u32).filter(|t| !banned.contains(t)) {
                m[(t / 64) as usize] |= 1 << (t % 64);
            }
            m
        };
        let few: Vec<u32> = (0..12).map(|i| i * 7).collect();
        assert_eq!(Allowed::new(mask_without(&few), 100).wire, Wire::Bans(few));
        let many: Vec<u32> = (0..13).collect();
        let Wire::Bits(bits) = Allowed::new(mask_without(&many), 100).wire else { panic!("13 bans of 100 go as bits") };
        assert_eq!(bits.len(), 13);
        assert_eq!((bits[0], bits[1], bits[12]), (0, 0b1110_0000, 0b0000_1111));
    }
}
