//! Conversions between the wire messages and the shared sampling types, in one place so the
//! rank and every test world read the proto's defaults the same way.

use minimax_shared::sampling::{RowReduction, SamplingSpec as Spec};

use super::{RowOutput, SamplingSpec};

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
