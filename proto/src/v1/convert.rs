//! Conversions between the wire messages and the shared sampling types, in one place so the
//! rank and every test world read the proto's defaults the same way.

use minimax_shared::sampling::draw::{DrawError, draw};
use minimax_shared::sampling::{RowReduction, SamplingSpec as Spec};

use super::{LateRule, RowOutput, SamplingSpec, TokenCount};

/// The gateway's sampling message as the reduction's spec. Proto3 defaults are mapped to "off":
/// an unset message or `temperature = 0` is greedy, `top_p` outside (0, 1) and
/// `repetition_penalty = 0` are off.
pub fn sampling_spec(s: Option<&SamplingSpec>) -> Spec {
    let Some(s) = s else {
        return Spec { temperature: 0.0, ..Default::default() };
    };
    Spec {
        temperature: s.temperature,
        top_k: s.top_k,
        top_p: if s.top_p > 0.0 && s.top_p < 1.0 { s.top_p } else { 1.0 },
        min_p: s.min_p,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        repetition_penalty: if s.repetition_penalty == 0.0 { 1.0 } else { s.repetition_penalty },
        logit_bias: s.logit_bias.iter().map(|b| (b.token, b.bias)).collect(),
        history: s.history.iter().map(|h| (h.token, h.count)).collect(),
        top_logprobs: s.top_logprobs,
        allowed: s.allowed_tokens.as_ref().map(|m| std::sync::Arc::from(m.as_slice())),
    }
}

/// One row's reduction as the head rank returns it for `position`.
pub fn row_output(position: u32, red: RowReduction) -> RowOutput {
    RowOutput {
        position,
        candidate_ids: red.candidate_ids,
        candidate_logits: red.candidate_logits,
        candidate_raw_logits: red.candidate_raw_logits,
        raw_logsumexp: red.raw_logsumexp,
        top_ids: red.top_ids,
        top_logprobs: red.top_logprobs,
        target_logprob: red.target_logprob.unwrap_or(0.0),
        drawn_token: None,
    }
}

/// Draws `row`'s token among its candidates with the uniform number `u` into `drawn_token`
/// (the head rank's draw, and the test worlds'); an error leaves it unset.
pub fn draw_row(row: &mut RowOutput, temperature: f32, u: f64) -> Result<u32, DrawError> {
    let k = draw(&row.candidate_ids, &row.candidate_logits, temperature, u)?;
    row.drawn_token = Some(row.candidate_ids[k]);
    Ok(row.candidate_ids[k])
}

/// Puts a row's late rule into the spec it was sent without (`rule_follows`): the fields the
/// rule replaces, so the reduction sees the row as if the rule had come with it.
pub fn apply_late_rule(spec: &mut SamplingSpec, rule: LateRule) {
    spec.logit_bias = rule.logit_bias;
    spec.allowed_tokens = rule.allowed_tokens;
    spec.rule_follows = false;
}

/// Counts one more `token` in the penalties' history (a fed token the gateway could not list).
pub fn count_in_history(spec: &mut SamplingSpec, token: u32) {
    match spec.history.iter_mut().find(|h| h.token == token) {
        Some(h) => h.count += 1,
        None => spec.history.push(TokenCount { token, count: 1 }),
    }
}
