//! Pieces shared by the generating endpoints.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{Value as Json, json};

use super::error::ApiError;
use super::run::{ChoiceJob, ChoiceKind, LogprobEntry, Run, Update};
use super::sse::ChunkEncoder;
use super::state::AppState;
use crate::engine::{GenerationRequest, SamplingParams, Usage};
use crate::text::prompt::PreparedChat;
use crate::text::tokenizer::Tokenizer;

/// 404 unless `model` is absent or the served id.
pub fn check_model(st: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != st.model.id => Err(ApiError::model_not_found(m, &st.model.id)),
        _ => Ok(()),
    }
}

/// Output budget: the request's `max_tokens`, clipped to the rest of the context; a prompt that
/// leaves no room is a 400.
pub fn max_tokens(st: &AppState, requested: Option<u32>, prompt_len: usize, param: &str) -> Result<u32, ApiError> {
    let ctx = st.model.context_length as usize;
    if prompt_len == 0 {
        return Err(ApiError::invalid(param, "the prompt is empty"));
    }
    if prompt_len >= ctx {
        let mut e = ApiError::invalid(
            param,
            format!("the prompt has {prompt_len} tokens; the model's context length is {ctx}, which leaves no room for output"),
        );
        e.code = Some("context_length_exceeded");
        return Err(e);
    }
    let room = (ctx - prompt_len) as u32;
    Ok(requested.map_or(room, |m| m.min(room)))
}

/// The one chat choice of a request that has a single answer (Responses, Messages): the
/// prepared prompt, `max` output tokens, end-of-generation tokens as stops, the chat parser.
pub fn single_chat_job(st: &AppState, prepared: &PreparedChat, id: &str, max: u32, sampling: SamplingParams, stop: Vec<String>) -> ChoiceJob {
    ChoiceJob {
        index: 0,
        prompt_index: 0,
        request: GenerationRequest {
            request_id: id.to_string(),
            prompt: prepared.prompt_ids.clone(),
            max_tokens: max,
            sampling,
            stop_token_ids: st.text.tokenizer().eog_ids(),
        },
        stop,
        kind: ChoiceKind::Chat(Box::new(st.text.output_parser(prepared))),
    }
}

/// Choice `i` of a seeded request gets its own seed so that `n` choices differ but each is
/// reproducible.
pub fn choice_sampling(s: &SamplingParams, i: u32) -> SamplingParams {
    let mut s = s.clone();
    if let Some(seed) = s.seed {
        s.seed = Some(seed.wrapping_add(i as u64));
    }
    s
}

/// Runs a single-answer request (Responses, Messages) to its end through `enc`, as its stream
/// would: the events, or an internal error naming `what` when the run ended without a result.
pub async fn run_to_end(run: &mut Run, enc: &mut dyn ChunkEncoder, deadline: Option<Instant>, timeout: Option<Duration>, what: &str) -> Result<Vec<Json>, ApiError> {
    let mut events = Vec::new();
    let mut ended = false;
    while let Some(u) = next_update(run, deadline, timeout).await {
        let u = u?;
        ended |= u.end.is_some();
        events.extend(enc.update(u)?);
        if run.all_done() {
            break;
        }
    }
    if !ended {
        return Err(ApiError::internal(format!("the {what} ended without a result")));
    }
    Ok(events)
}

/// The next update, or a timeout error once the deadline passed (the run is cancelled).
pub async fn next_update(run: &mut Run, deadline: Option<Instant>, timeout: Option<Duration>) -> Option<Result<Update, ApiError>> {
    match deadline {
        None => run.next().await,
        Some(d) => match tokio::time::timeout_at(tokio::time::Instant::from_std(d), run.next()).await {
            Ok(x) => x,
            Err(_) => {
                let e = ApiError::timeout(timeout.unwrap_or_default().as_secs_f64());
                run.fail(&e.message);
                Some(Err(e))
            }
        },
    }
}

/// OpenAI `usage`, with `prompt_tokens_details.cached_tokens`.
pub fn usage_json(u: &Usage) -> Json {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

fn token_str(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let b = tok.token_bytes(id).to_vec();
    (String::from_utf8_lossy(&b).into_owned(), b)
}

/// Chat `logprobs.content` entries.
pub fn chat_logprobs(tok: &Tokenizer, entries: &[LogprobEntry]) -> Json {
    let content: Vec<Json> = entries
        .iter()
        .map(|e| {
            let (t, b) = token_str(tok, e.id);
            let top: Vec<Json> = e
                .top
                .iter()
                .map(|(id, lp)| {
                    let (t, b) = token_str(tok, *id);
                    json!({"token": t, "logprob": lp, "bytes": b})
                })
                .collect();
            json!({"token": t, "logprob": e.logprob, "bytes": b, "top_logprobs": top})
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// Completions `logprobs` (legacy shape). `offset` is the text offset of the first entry and is
/// advanced.
pub fn completion_logprobs(tok: &Tokenizer, entries: &[LogprobEntry], offset: &mut usize, with_top: bool) -> Json {
    let mut tokens = Vec::new();
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    let mut offs = Vec::new();
    for e in entries {
        let (t, _) = token_str(tok, e.id);
        offs.push(*offset);
        *offset += t.len();
        tokens.push(Json::String(t));
        lps.push(json!(e.logprob));
        let mut m = serde_json::Map::new();
        for (id, lp) in &e.top {
            m.insert(token_str(tok, *id).0, json!(lp));
        }
        tops.push(Json::Object(m));
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": if with_top { Json::Array(tops) } else { Json::Null }, "text_offset": offs})
}
