//! Streaming detokenization: token bytes in, complete UTF-8 text out.
//!
//! Byte-level BPE splits multi-byte characters across tokens. The decoder holds back an
//! incomplete trailing sequence until the next token completes it, and replaces bytes that can
//! never become valid with U+FFFD exactly where `String::from_utf8_lossy` would, so the
//! concatenation of all deltas equals the one-shot decode.

/// Per-stream decoder state.
#[derive(Debug, Default, Clone)]
pub struct IncrementalDecoder {
    pending: Vec<u8>,
}

impl IncrementalDecoder {
    /// A decoder with nothing pending.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one token's bytes and returns the text that is now complete (maybe empty).
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    out.push_str(
                        std::str::from_utf8(&self.pending[start..valid]).expect("validated prefix"),
                    );
                    match e.error_len() {
                        // Invalid for good: one replacement character per maximal bad run.
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid + n;
                        }
                        // Incomplete at the end: wait for more bytes.
                        None => {
                            start = valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// Whether bytes are held back waiting for the rest of a character.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Ends the stream: an unfinished character becomes U+FFFD, as the one-shot decode has it.
    pub fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_split_characters() {
        let mut d = IncrementalDecoder::new();
        let e = "é".as_bytes();
        assert_eq!(d.push(&e[..1]), "");
        assert!(d.has_pending());
        assert_eq!(d.push(&e[1..]), "é");
        let rocket = "🚀".as_bytes();
        assert_eq!(d.push(&[b'a', rocket[0]]), "a");
        assert_eq!(d.push(&rocket[1..3]), "");
        assert_eq!(d.push(&rocket[3..]), "🚀");
        assert_eq!(d.finish(), "");
    }

    #[test]
    fn invalid_bytes_become_replacement_like_lossy() {
        let mut d = IncrementalDecoder::new();
        let mut all = String::new();
        for chunk in [&[0xffu8][..], &[b'x', 0xe2, 0x82], b"y", &[0xf0, 0x9f]] {
            all.push_str(&d.push(chunk));
        }
        all.push_str(&d.finish());
        let bytes = [0xffu8, b'x', 0xe2, 0x82, b'y', 0xf0, 0x9f];
        assert_eq!(all, String::from_utf8_lossy(&bytes));
    }
}
