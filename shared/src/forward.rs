//! The batch-shaped forward contract every backend (CPU reference, CUDA, a whole rank world)
//! implements: a flat batch of new tokens from many sequences, a paged KV cache addressed by
//! per-sequence page tables, and logits only where asked. Prefill chunks and decode tokens are
//! the same thing with different lengths.

/// Which logits a sequence wants back from this step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LogitsWanted {
    /// None (a prefill chunk that is not the last one).
    #[default]
    None,
    /// The last new token's (decode, or the final prefill chunk).
    Last,
    /// Every new token's (teacher-forced scoring).
    All,
}

/// One sequence's part of a step.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct SeqStep {
    /// Caller's id for the sequence (for error messages and the KV-length handshake).
    pub seq_id: u64,
    /// Physical KV page of each logical page: position `p` lives in page
    /// `page_table[p / page_size]`, slot `p % page_size`. Must cover `cached_len + tokens.len()`.
    pub page_table: Vec<u32>,
    /// Tokens already in the cache for this sequence; the new tokens take positions
    /// `cached_len..cached_len + tokens.len()`.
    pub cached_len: usize,
    /// The new tokens.
    pub tokens: Vec<u32>,
    pub logits: LogitsWanted,
}

impl SeqStep {
    /// Indices, among this step's new tokens, whose logits are wanted.
    pub fn wanted(&self) -> std::ops::Range<usize> {
        let n = self.tokens.len();
        match self.logits {
            LogitsWanted::None => 0..0,
            LogitsWanted::Last => n.saturating_sub(1)..n,
            LogitsWanted::All => 0..n,
        }
    }
}

/// A step: sequences in order; their new tokens form one flat batch.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct ForwardBatch {
    pub seqs: Vec<SeqStep>,
}

/// Where one returned logits row comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogitsRow {
    /// Index into `ForwardBatch::seqs`.
    pub seq: usize,
    /// Absolute position of the token whose next-token distribution this row is.
    pub position: usize,
}

/// Logits for the rows asked for, in batch order (sequence order, then position order).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct ForwardOutput {
    pub rows: Vec<LogitsRow>,
    /// `rows.len() * vocab_size` values, row-major.
    pub logits: Vec<f32>,
    pub vocab_size: usize,
}

impl ForwardOutput {
    /// The logits of row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.logits[i * self.vocab_size..(i + 1) * self.vocab_size]
    }
}

/// Why a batch cannot be executed as given; nothing in the cache changes when this is returned.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum BatchError {
    #[error("sequence {seq_id}: no new tokens")]
    Empty { seq_id: u64 },
    #[error("sequence {seq_id}: token id {token} is outside the vocabulary ({vocab})")]
    TokenOutOfRange { seq_id: u64, token: u32, vocab: usize },
    #[error("sequence {seq_id}: {needed} positions need {pages} pages, page table has {have}")]
    PageTableShort { seq_id: u64, needed: usize, pages: usize, have: usize },
    #[error("sequence {seq_id}: page {page} does not exist (cache has {n_pages} pages)")]
    PageOutOfRange { seq_id: u64, page: u32, n_pages: usize },
    #[error("sequence {seq_id}: {needed} positions exceed the context length {context}")]
    TooLong { seq_id: u64, needed: usize, context: usize },
    #[error("sequences {a} and {b} write the same KV page {page}")]
    PageConflict { a: u64, b: u64, page: u32 },
}

impl ForwardBatch {
    /// Every wanted logits row, in output order, with the index of its token in the flat batch.
    pub fn logits_rows(&self) -> Vec<(LogitsRow, usize)> {
        let mut out = Vec::new();
        let mut offset = 0;
        for (si, s) in self.seqs.iter().enumerate() {
            for i in s.wanted() {
                out.push((LogitsRow { seq: si, position: s.cached_len + i }, offset + i));
            }
            offset += s.tokens.len();
        }
        out
    }

    /// Total new tokens in the batch.
    pub fn n_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }

    /// Checks the batch against a cache of `n_pages` pages of `page_size` tokens, a vocabulary
    /// and a context length, so a backend can reject it before touching any state.
    pub fn validate(&self, page_size: usize, n_pages: usize, vocab: usize, context: usize) -> Result<(), BatchError> {
        let mut writers: std::collections::HashMap<u32, u64> = std::collections::HashMap::new();
        for s in &self.seqs {
            if s.tokens.is_empty() {
                return Err(BatchError::Empty { seq_id: s.seq_id });
            }
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(BatchError::TokenOutOfRange { seq_id: s.seq_id, token: t, vocab });
            }
            let needed = s.cached_len + s.tokens.len();
            if needed > context {
                return Err(BatchError::TooLong { seq_id: s.seq_id, needed, context });
            }
            let pages = needed.div_ceil(page_size);
            if s.page_table.len() < pages {
                return Err(BatchError::PageTableShort { seq_id: s.seq_id, needed, pages, have: s.page_table.len() });
            }
            if let Some(&p) = s.page_table[..pages].iter().find(|&&p| p as usize >= n_pages) {
                return Err(BatchError::PageOutOfRange { seq_id: s.seq_id, page: p, n_pages });
            }
            // Pages this step writes into must belong to one sequence only.
            for &p in &s.page_table[s.cached_len / page_size..pages] {
                if let Some(&other) = writers.get(&p)
                    && other != s.seq_id
                {
                    return Err(BatchError::PageConflict { a: other, b: s.seq_id, page: p });
                }
                writers.insert(p, s.seq_id);
            }
        }
        Ok(())
    }
}
