//! Sampling in the gateway, among the candidates the head rank returns.
//!
//! The head rank has already applied, per the proto's `SamplingSpec`: repetition, presence and
//! frequency penalties over the request's history, `logit_bias`, temperature and the
//! top-k / top-p / min-p filters. It returns the surviving candidates with their final
//! (sampling) logits, their raw logits and the raw log-sum-exp, plus the raw top alternatives.
//! What is left here is exact and cheap:
//!
//! - every sampled step takes the next uniform number of a ChaCha20 stream per request, seeded
//!   from `seed` (or the OS), at plan time; it travels with the step (`SamplingSpec.draw`), the
//!   head rank draws the token with it (`minimax_shared::sampling::draw`) and feeds it to the
//!   next step at once (overlapped decode), and this module draws again with the same number
//!   and checks the rank's token;
//! - the draw: greedy (temperature 0) takes the candidate with the highest final logit (ties:
//!   lowest id); otherwise softmax over the candidates' final logits in a canonical order
//!   (logit descending, id ascending), so the result does not depend on the order a rank lists
//!   them in, nor on which other sequences share the step: the same seed gives the same tokens
//!   whatever the batching;
//! - logprobs: raw logit − raw log-sum-exp (the model's distribution, before any sampling
//!   transform, as OpenAI reports them); top_logprobs straight from the rank;
//! - structured outputs: a constrained request's spec carries the step's allowed-token mask
//!   (or, inside the reasoning block, bans its end-of-generation tokens), and every sampled
//!   token moves the request's matcher on (`crate::constrain`).

use std::collections::HashMap;

use minimax_proto::v1::{RowOutput, SamplingSpec, TokenBias, TokenCount};
use minimax_shared::sampling::draw::{DrawError, draw};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

use crate::constrain::vocab::Wire;
use crate::constrain::{Constraint, ConstraintError, Rule};
use crate::engine::{SamplingParams, TokenLogprob};

/// Per-request sampling state: the RNG stream and the generated-token counts the rank's
/// penalties need.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha20Rng,
    history: HashMap<u32, u32>,
    constraint: Option<Constraint>,
}

/// Why a row could not be sampled (the rank broke the contract).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SampleError {
    #[error(transparent)]
    Draw(#[from] DrawError),
    #[error("the head rank returned {ids} candidate ids but {raw} raw logits")]
    RaggedRaw { ids: usize, raw: usize },
    #[error("the head rank drew token {rank}, but the step's uniform number draws token {gateway}")]
    DrawMismatch { rank: u32, gateway: u32 },
    #[error("structured output: {0}")]
    Constraint(#[from] ConstraintError),
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
        let constraint = params.constraint.clone().map(Constraint::new);
        Self { params, rng: ChaCha20Rng::seed_from_u64(seed), history: HashMap::new(), constraint }
    }

    /// Whether the request's next step's rule depends on the token drawn now (structured
    /// outputs, the inside of a guided tool call): fed from the rank's own draw (overlapped
    /// decode), its step then carries no rule ([`Sampler::next_spec_late`]) and the rule
    /// follows ([`Sampler::late_rule`]).
    pub fn needs_drawn_token(&self) -> bool {
        self.constraint.as_ref().is_some_and(Constraint::needs_drawn_token)
    }

    /// Whether the request has a rule at all (structured outputs, guided tool calls).
    pub fn is_constrained(&self) -> bool {
        self.constraint.is_some()
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Counts a token of the request's output (penalties apply to generated tokens).
    pub fn observe(&mut self, token: u32) {
        *self.history.entry(token).or_insert(0) += 1;
    }

    /// The request's next uniform number in [0, 1): one per sampled step, taken when the step
    /// is planned, so the stream (and a seeded request's tokens) does not depend on batching.
    pub fn next_draw(&mut self) -> f64 {
        self.rng.random::<f64>()
    }

    /// The spec of the request's next sampled step, with the uniform number it takes.
    pub fn next_spec(&mut self) -> (SamplingSpec, f64) {
        let u = self.next_draw();
        let mut spec = self.spec(u);
        if let Some((bias, allowed)) = self.rule() {
            spec.logit_bias = bias;
            spec.allowed_tokens = allowed;
        }
        (spec, u)
    }

    /// [`Sampler::next_spec`] for a step planned before the token the rule depends on is
    /// known (overlapped decode): a constrained request's spec says its rule follows, and
    /// [`Sampler::late_rule`] gives that rule once every earlier token was sampled here.
    pub fn next_spec_late(&mut self) -> (SamplingSpec, f64) {
        if self.constraint.is_none() {
            return self.next_spec();
        }
        let u = self.next_draw();
        let mut spec = self.spec(u);
        spec.logit_bias.clear();
        spec.rule_follows = true;
        (spec, u)
    }

    /// The rule of the step [`Sampler::next_spec_late`] planned, for the rank's
    /// `LateRule`: the logit bias and the allowed tokens after every token sampled so far.
    pub fn late_rule(&mut self) -> (Vec<TokenBias>, Option<Vec<u8>>) {
        self.rule().unwrap_or_else(|| (self.base_bias(), None))
    }

    /// The request's own logit bias, by token.
    fn base_bias(&self) -> Vec<TokenBias> {
        let mut bias: Vec<TokenBias> = self.params.logit_bias.iter().map(|(&token, &bias)| TokenBias { token, bias }).collect();
        bias.sort_by_key(|b| b.token);
        bias
    }

    /// The request's logit bias with the constraint's next rule applied, and its mask; `None`
    /// without a constraint.
    fn rule(&mut self) -> Option<(Vec<TokenBias>, Option<Vec<u8>>)> {
        self.constraint.as_ref()?;
        let mut bias = self.base_bias();
        let c = self.constraint.as_mut()?;
        let mut allowed = None;
        match c.rule() {
            Rule::Free => {}
            Rule::NoEnd => {
                for &t in c.eog() {
                    match bias.iter_mut().find(|b| b.token == t) {
                        Some(b) => b.bias = f32::NEG_INFINITY,
                        None => bias.push(TokenBias { token: t, bias: f32::NEG_INFINITY }),
                    }
                }
            }
            // The mask in the form made with it (`vocab::Wire`).
            Rule::Only(a) => match &a.wire {
                Wire::Bans(bans) => {
                    bias.retain(|b| bans.binary_search(&b.token).is_err());
                    bias.extend(bans.iter().map(|&token| TokenBias { token, bias: f32::NEG_INFINITY }));
                }
                Wire::Bits(bytes) => allowed = Some(bytes.clone()),
            },
        }
        bias.sort_by_key(|b| b.token);
        Some((bias, allowed))
    }

    /// What the head rank must reduce this request's next row to, and the uniform number it
    /// draws the token with. The history holds the tokens sampled so far here; an overlapped
    /// step's rank adds the token it feeds.
    pub fn spec(&self, draw: f64) -> SamplingSpec {
        let p = &self.params;
        let logit_bias = self.base_bias();
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
            draw: Some(draw),
            allowed_tokens: None,
            rule_follows: false,
        }
    }

    /// Draws the next token from a row with the step's uniform number `u`, checks it against
    /// the rank's draw and records it in the history.
    pub fn sample(&mut self, row: &RowOutput, u: f64) -> Result<Sampled, SampleError> {
        let (ids, raw) = (&row.candidate_ids, &row.candidate_raw_logits);
        if !raw.is_empty() && raw.len() != ids.len() {
            return Err(SampleError::RaggedRaw { ids: ids.len(), raw: raw.len() });
        }
        let pick = draw(ids, &row.candidate_logits, self.params.temperature, u)?;
        if let Some(t) = row.drawn_token
            && t != ids[pick]
        {
            return Err(SampleError::DrawMismatch { rank: t, gateway: ids[pick] });
        }
        let token = ids[pick];
        if let Some(c) = &mut self.constraint {
            c.advance(token)?;
        }
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
