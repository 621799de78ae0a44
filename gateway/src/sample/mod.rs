//! Sampling in the gateway, among the candidates the head rank returns.
//!
//! The head rank has already applied, per the proto's `SamplingSpec`: repetition, presence and
//! frequency penalties over the request's history, `logit_bias`, temperature and the
//! top-k / top-p / min-p filters. It returns the surviving candidates with their final
//! (sampling) logits, their raw logits and the raw log-sum-exp, plus the raw top alternatives.
//! What is left here is exact and cheap:
//!
//! - greedy (temperature 0): the candidate with the highest final logit (ties: lowest id);
//! - otherwise: softmax over the candidates' final logits and one uniform draw from a ChaCha20
//!   stream per request, seeded from `seed` (or the OS). Candidates are put in a canonical
//!   order (logit descending, id ascending) before drawing, so the result does not depend on
//!   the order a rank lists them in, nor on which other sequences share the step: the same
//!   seed gives the same tokens whatever the batching;
//! - logprobs: raw logit − raw log-sum-exp (the model's distribution, before any sampling
//!   transform, as OpenAI reports them); top_logprobs straight from the rank.

use std::collections::HashMap;

use minimax_proto::v1::{RowOutput, SamplingSpec, TokenBias, TokenCount};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

use crate::engine::{SamplingParams, TokenLogprob};

/// Per-request sampling state: the RNG stream and the generated-token counts the rank's
/// penalties need.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha20Rng,
    history: HashMap<u32, u32>,
}

/// Why a row could not be sampled (the rank broke the contract).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SampleError {
    #[error("the head rank returned no candidates")]
    NoCandidates,
    #[error("the head rank returned {ids} candidate ids but {logits} logits / {raw} raw logits")]
    Ragged { ids: usize, logits: usize, raw: usize },
    #[error("the candidates' logits are not finite")]
    NotFinite,
}

/// One sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: Option<TokenLogprob>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(|| rand::rng().random());
        Self { params, rng: ChaCha20Rng::seed_from_u64(seed), history: HashMap::new() }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Counts a token of the request's output (penalties apply to generated tokens).
    pub fn observe(&mut self, token: u32) {
        *self.history.entry(token).or_insert(0) += 1;
    }

    /// What the head rank must reduce this request's next row to.
    pub fn spec(&self) -> SamplingSpec {
        let p = &self.params;
        let mut logit_bias: Vec<TokenBias> = p.logit_bias.iter().map(|(&token, &bias)| TokenBias { token, bias }).collect();
        logit_bias.sort_by_key(|b| b.token);
        let mut history: Vec<TokenCount> = self.history.iter().map(|(&token, &count)| TokenCount { token, count }).collect();
        history.sort_by_key(|c| c.token);
        SamplingSpec {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            repetition_penalty: p.repetition_penalty,
            logit_bias,
            history,
            top_logprobs: if p.logprobs || p.top_logprobs > 0 { p.top_logprobs.min(20) } else { 0 },
        }
    }

    /// Draws the next token from a row and records it in the history.
    pub fn sample(&mut self, row: &RowOutput) -> Result<Sampled, SampleError> {
        let (ids, logits, raw) = (&row.candidate_ids, &row.candidate_logits, &row.candidate_raw_logits);
        if ids.is_empty() {
            return Err(SampleError::NoCandidates);
        }
        if logits.len() != ids.len() || (!raw.is_empty() && raw.len() != ids.len()) {
            return Err(SampleError::Ragged { ids: ids.len(), logits: logits.len(), raw: raw.len() });
        }
        // Canonical order: final logit descending, id ascending. NaN is a contract breach.
        if logits.iter().any(|l| l.is_nan()) {
            return Err(SampleError::NotFinite);
        }
        let mut order: Vec<usize> = (0..ids.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(ids[a].cmp(&ids[b])));
        let pick = if self.params.temperature <= 0.0 || order.len() == 1 {
            order[0]
        } else {
            let max = logits[order[0]] as f64;
            if !max.is_finite() {
                return Err(SampleError::NotFinite);
            }
            let weights: Vec<f64> = order.iter().map(|&i| (logits[i] as f64 - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            let u: f64 = self.rng.random::<f64>() * total;
            let mut acc = 0.0;
            let mut chosen = order[order.len() - 1];
            for (k, &i) in order.iter().enumerate() {
                acc += weights[k];
                if u < acc {
                    chosen = i;
                    break;
                }
            }
            chosen
        };
        let token = ids[pick];
        self.observe(token);
        let logprob = if self.params.logprobs || self.params.top_logprobs > 0 {
            let lp = if raw.is_empty() { f32::NAN } else { raw[pick] - row.raw_logsumexp };
            let top = row.top_ids.iter().copied().zip(row.top_logprobs.iter().copied()).take(self.params.top_logprobs as usize).collect();
            Some(TokenLogprob { logprob: lp, top })
        } else {
            None
        };
        Ok(Sampled { token, logprob })
    }
}

#[cfg(test)]
mod tests;
