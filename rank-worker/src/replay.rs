//! TEST ONLY: scripted token replay on the head rank.
//!
//! The tiny fixture models have random weights, so their output is noise and never exercises
//! the gateway's reasoning and tool-call paths. With `--test-replay FILE` (hidden flag, or env
//! `MINIMAX_TEST_REPLAY`) **and** env `MINIMAX_ALLOW_TEST_HOOKS=1`, the head rank replaces the
//! sampling candidates of a sequence whose prompt contains a script's `trigger` with exactly
//! one candidate: the script's next token (then the end-of-sequence token). Everything else —
//! the forward pass, the KV handshake, the gateway's sampling, detokenization, parsing and
//! SSE — runs for real. Without both switches the option is refused at startup.
//!
//! File format (JSON):
//! ```json
//! {"scripts": [{"trigger": "REPLAY:tools", "text": "Thinking…</think>\n\n<minimax:tool_call>…"},
//!              {"trigger": "REPLAY:ids", "tokens": [12, 34]},
//!              {"trigger": "REPLAY:json", "text": "ok</think>\n\n", "then": "sample"}]}
//! ```
//! `"then": "sample"` lets the model sample normally after the script (instead of ending it):
//! structured-output tests script the reasoning block and let the masks shape the rest.
//! `text` is turned into tokens by greedy longest match over the model's vocabulary (every
//! byte has a token in a byte-level BPE, so any text is reachable and decodes back exactly).
//!
//! The trigger is searched in the sequence's whole token history, which is rebuilt from the
//! page tables of executed steps (so a prompt partly served from the prefix cache works too).

use std::collections::HashMap;
use std::path::Path;

use minimax_shared::gguf::Metadata;

/// The env switch that must be `1` for any test hook to be accepted.
pub const ALLOW_ENV: &str = "MINIMAX_ALLOW_TEST_HOOKS";

/// Why a replay file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("--test-replay is a test hook: set {ALLOW_ENV}=1 to allow it (never in production)")]
    NotAllowed,
    #[error("replay file {path}: {why}")]
    File { path: String, why: String },
    #[error("replay: the model has no usable vocabulary: {0}")]
    Vocab(String),
}

#[derive(Debug, Clone, PartialEq)]
struct Script {
    trigger: String,
    tokens: Vec<u32>,
    /// After the script: sample normally (`true`) or end the sequence.
    then_sample: bool,
}

#[derive(Debug, Clone, PartialEq)]
enum SeqPlan {
    /// No trigger in the prompt: normal sampling.
    None,
    /// Replaying `script`; the first scripted token is at position `start`.
    Script { script: usize, start: u32 },
}

/// The scripted replay state of one rank.
#[derive(Debug)]
pub struct Replay {
    scripts: Vec<Script>,
    vocab: Vec<Vec<u8>>,
    eos: u32,
    page_size: usize,
    /// Tokens written to each physical page slot by executed steps.
    pages: HashMap<u32, Vec<u32>>,
    plans: HashMap<u64, SeqPlan>,
}

/// The single candidate a replayed row returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Forced {
    pub token: u32,
}

/// GPT-2 byte-level alphabet: the char each byte is written as in vocab strings.
fn byte_level_decoder() -> HashMap<char, u8> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    bs.into_iter().zip(cs).map(|(b, c)| (char::from_u32(c).unwrap(), b as u8)).collect()
}

/// Token id → bytes, as the gateway decodes them (control / user-defined tokens verbatim).
pub fn vocab_bytes(meta: &Metadata) -> Result<Vec<Vec<u8>>, ReplayError> {
    let tokens = meta
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.as_array())
        .ok_or_else(|| ReplayError::Vocab("no tokenizer.ggml.tokens".into()))?;
    let types: Vec<i64> = meta
        .get("tokenizer.ggml.token_type")
        .and_then(|v| v.as_array())
        .map(|a| a.iter().map(|x| x.as_i64().unwrap_or(1)).collect())
        .unwrap_or_default();
    let dec = byte_level_decoder();
    tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let s = t.as_str().ok_or_else(|| ReplayError::Vocab(format!("token {i} is not a string")))?;
            let ty = types.get(i).copied().unwrap_or(1);
            Ok(if ty == 3 || ty == 4 {
                s.as_bytes().to_vec()
            } else {
                let mut out = Vec::with_capacity(s.len());
                for ch in s.chars() {
                    match dec.get(&ch) {
                        Some(&b) => out.push(b),
                        None => out.extend_from_slice(ch.to_string().as_bytes()),
                    }
                }
                out
            })
        })
        .collect()
}

/// Greedy longest-match encoding of `text` over `vocab` (tests only; not BPE-exact, but it
/// decodes back to `text` byte for byte).
pub fn greedy_encode(vocab: &[Vec<u8>], text: &str) -> Result<Vec<u32>, String> {
    let mut by_first: HashMap<u8, Vec<(usize, u32)>> = HashMap::new();
    for (id, b) in vocab.iter().enumerate() {
        if let Some(&f) = b.first() {
            by_first.entry(f).or_default().push((b.len(), id as u32));
        }
    }
    for v in by_first.values_mut() {
        v.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    }
    let bytes = text.as_bytes();
    let mut i = 0;
    let mut out = Vec::new();
    while i < bytes.len() {
        let cands = by_first.get(&bytes[i]).ok_or_else(|| format!("byte {:#04x} has no token", bytes[i]))?;
        let &(len, id) = cands
            .iter()
            .find(|(len, id)| bytes[i..].starts_with(&vocab[*id as usize][..*len]))
            .ok_or_else(|| format!("no token matches at byte {i}"))?;
        out.push(id);
        i += len;
    }
    Ok(out)
}

impl Replay {
    /// Loads a replay file, refusing unless the test-hook env switch is set.
    pub fn load(path: &Path, meta: &Metadata, page_size: usize) -> Result<Replay, ReplayError> {
        if std::env::var(ALLOW_ENV).as_deref() != Ok("1") {
            return Err(ReplayError::NotAllowed);
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| ReplayError::File { path: path.display().to_string(), why: e.to_string() })?;
        Self::from_json(&text, meta, page_size).map_err(|why| ReplayError::File { path: path.display().to_string(), why })
    }

    /// Parses a replay document (no env check: unit tests).
    pub fn from_json(text: &str, meta: &Metadata, page_size: usize) -> Result<Replay, String> {
        let vocab = vocab_bytes(meta).map_err(|e| e.to_string())?;
        let eos = meta
            .get("tokenizer.ggml.eos_token_id")
            .and_then(|v| v.as_u64())
            .ok_or("the model has no tokenizer.ggml.eos_token_id")? as u32;
        let doc: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let list = doc.get("scripts").and_then(|s| s.as_array()).ok_or("expected {\"scripts\": [...]}")?;
        let mut scripts = Vec::new();
        for (i, s) in list.iter().enumerate() {
            let trigger = s.get("trigger").and_then(|t| t.as_str()).filter(|t| !t.is_empty());
            let trigger = trigger.ok_or(format!("scripts[{i}].trigger: a non-empty string is required"))?.to_string();
            let tokens = match (s.get("text").and_then(|t| t.as_str()), s.get("tokens").and_then(|t| t.as_array())) {
                (Some(t), None) => greedy_encode(&vocab, t).map_err(|e| format!("scripts[{i}].text: {e}"))?,
                (None, Some(ids)) => ids
                    .iter()
                    .map(|x| x.as_u64().filter(|&x| (x as usize) < vocab.len()).map(|x| x as u32))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or(format!("scripts[{i}].tokens: token ids below {} expected", vocab.len()))?,
                _ => return Err(format!("scripts[{i}]: exactly one of `text` or `tokens` is required")),
            };
            let then_sample = match s.get("then").map(|t| t.as_str()) {
                None | Some(Some("end")) => false,
                Some(Some("sample")) => true,
                _ => return Err(format!("scripts[{i}].then: `end` (default) or `sample` expected")),
            };
            scripts.push(Script { trigger, tokens, then_sample });
        }
        Ok(Replay { scripts, vocab, eos, page_size: page_size.max(1), pages: HashMap::new(), plans: HashMap::new() })
    }

    /// Records the tokens an executed step wrote (every sequence of the batch).
    pub fn observe(&mut self, seq_id: u64, page_table: &[u32], cached_len: u32, tokens: &[u32]) {
        if cached_len == 0 {
            // A new sequence (or a full recompute): decide again.
            self.plans.remove(&seq_id);
        }
        for (i, &t) in tokens.iter().enumerate() {
            let pos = cached_len as usize + i;
            let Some(&page) = page_table.get(pos / self.page_size) else { continue };
            let slots = self.pages.entry(page).or_insert_with(|| vec![0; self.page_size]);
            slots[pos % self.page_size] = t;
        }
    }

    /// The forced next token for the row at absolute `position` of `seq_id` (the token that
    /// will sit at `position + 1`), or `None` to sample normally.
    pub fn forced(&mut self, seq_id: u64, page_table: &[u32], position: u32) -> Option<Forced> {
        if !self.plans.contains_key(&seq_id) {
            let len = position as usize + 1;
            let mut bytes = Vec::new();
            for pos in 0..len {
                let page = page_table.get(pos / self.page_size)?;
                let tok = self.pages.get(page).map(|s| s[pos % self.page_size]).unwrap_or(0);
                bytes.extend_from_slice(self.vocab.get(tok as usize).map(|v| &v[..]).unwrap_or(&[]));
            }
            let text = String::from_utf8_lossy(&bytes);
            let plan = match self.scripts.iter().position(|s| text.contains(&s.trigger)) {
                Some(script) => {
                    tracing::warn!(seq_id, trigger = %self.scripts[script].trigger, "TEST REPLAY: forcing a scripted answer");
                    SeqPlan::Script { script, start: position + 1 }
                }
                None => SeqPlan::None,
            };
            self.plans.insert(seq_id, plan);
        }
        match self.plans[&seq_id] {
            SeqPlan::None => None,
            SeqPlan::Script { script, start } => {
                let k = (position + 1).checked_sub(start)? as usize;
                let sc = &self.scripts[script];
                match sc.tokens.get(k) {
                    Some(&token) => Some(Forced { token }),
                    None if sc.then_sample => None,
                    None => Some(Forced { token: self.eos }),
                }
            }
        }
    }

    /// Forgets released sequences.
    pub fn release(&mut self, seq_ids: &[u64]) {
        for s in seq_ids {
            self.plans.remove(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use minimax_shared::gguf::GgufModel;

    fn meta() -> GgufModel {
        GgufModel::open(concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/m2-small/q8_0.gguf")).unwrap()
    }

    #[test]
    fn greedy_encoding_round_trips() {
        let m = meta();
        let vocab = vocab_bytes(m.metadata()).unwrap();
        for text in ["hello world", "<think>\nhmm</think>\n\nÜber 🎉", "<minimax:tool_call>\n<invoke name=\"f\">"] {
            let ids = greedy_encode(&vocab, text).unwrap();
            let back: Vec<u8> = ids.iter().flat_map(|&i| vocab[i as usize].clone()).collect();
            assert_eq!(String::from_utf8(back).unwrap(), text);
        }
    }

    #[test]
    fn replays_after_trigger_then_eos() {
        let m = meta();
        let vocab = vocab_bytes(m.metadata()).unwrap();
        let doc = r#"{"scripts": [{"trigger": "XYZ", "tokens": [5, 6]}]}"#;
        let mut r = Replay::from_json(doc, m.metadata(), 4).unwrap();
        let prompt = greedy_encode(&vocab, "ab XYZ cd").unwrap();
        let pages = [7u32, 3, 9, 1];
        r.observe(1, &pages, 0, &prompt);
        let p = prompt.len() as u32;
        assert_eq!(r.forced(1, &pages, p - 1), Some(Forced { token: 5 }));
        r.observe(1, &pages, p, &[5]);
        assert_eq!(r.forced(1, &pages, p), Some(Forced { token: 6 }));
        assert_eq!(r.forced(1, &pages, p + 1), Some(Forced { token: r.eos }));
        // No trigger: sample normally. A prefix adopted from cached pages is still seen.
        let other = greedy_encode(&vocab, "nothing here").unwrap();
        r.observe(2, &[11, 12, 13, 14], 0, &other);
        assert_eq!(r.forced(2, &[11, 12, 13, 14], other.len() as u32 - 1), None);
        r.observe(3, &pages, 4, &prompt[4..]);
        assert_eq!(r.forced(3, &pages, p - 1), Some(Forced { token: 5 }));
    }

    #[test]
    fn then_sample_hands_over_after_the_script() {
        let m = meta();
        let vocab = vocab_bytes(m.metadata()).unwrap();
        let doc = r#"{"scripts": [{"trigger": "XYZ", "tokens": [5], "then": "sample"}]}"#;
        let mut r = Replay::from_json(doc, m.metadata(), 4).unwrap();
        let prompt = greedy_encode(&vocab, "XYZ").unwrap();
        let pages = [1u32, 2, 3];
        r.observe(1, &pages, 0, &prompt);
        let p = prompt.len() as u32;
        assert_eq!(r.forced(1, &pages, p - 1), Some(Forced { token: 5 }));
        assert_eq!(r.forced(1, &pages, p), None, "sampled after the script, not ended");
        assert!(Replay::from_json(r#"{"scripts": [{"trigger": "a", "tokens": [1], "then": "stop"}]}"#, m.metadata(), 4).is_err());
    }

    #[test]
    fn refused_without_the_env_switch() {
        // SAFETY-free check: only reads the env; the variable is not set in the test run.
        if std::env::var(ALLOW_ENV).is_err() {
            let m = meta();
            let e = Replay::load(Path::new("/nonexistent"), m.metadata(), 64).unwrap_err();
            assert!(matches!(e, ReplayError::NotAllowed));
        }
        let m = meta();
        assert!(Replay::from_json(r#"{"scripts": [{"trigger": ""}]}"#, m.metadata(), 4).is_err());
        assert!(Replay::from_json(r#"{"scripts": [{"trigger": "a", "tokens": [999999]}]}"#, m.metadata(), 4).is_err());
    }
}
