//! `POST /v1/messages` and `POST /v1/messages/count_tokens`: the Anthropic Messages API, so
//! agents built on it (Claude Code and others that speak Anthropic's protocol) run against the
//! same engine, chat template, reasoning split and tool-call parser as `/v1/chat/completions`.
//! The request is read into the chat path's form (`request.rs`); the answer is Anthropic's
//! message (`thinking`, `text` and `tool_use` blocks, `stop_reason`, `usage`) or its event
//! stream (`stream.rs`); errors are Anthropic's `{"type":"error","error":{...}}` (`error.rs`).
//! See docs/API.md "Anthropic Messages API".

pub mod error;
pub mod request;
pub mod stream;

use std::time::Instant;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::{Value as Json, json};

use super::body::json_object;
use super::common::{max_tokens, run_to_end, single_chat_job};
use super::error::ApiError;
use super::run::{ChoiceEnd, RequestLog, Run};
use super::sse::ChunkEncoder;
use super::state::{AppState, new_id};
use crate::engine::Usage;

pub async fn handler(State(st): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match messages(st, headers, body).await {
        Ok(r) => r,
        Err(e) => error::response(&e),
    }
}

pub async fn count_tokens(State(st): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let r = async {
        let obj = json_object(&headers, body, st.args.max_body_bytes).await?;
        let (chat, _) = request::read(&obj, &st.sampling_defaults, true)?;
        let prepared = st.text.prepare(&chat).map_err(|e| request::anthropic_names(e.into()))?;
        Ok::<_, ApiError>(super::error::json_response(StatusCode::OK, &json!({"input_tokens": prepared.prompt_ids.len()})))
    };
    r.await.unwrap_or_else(|e| error::response(&e))
}

async fn messages(st: AppState, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let started = Instant::now();
    let obj = json_object(&headers, body, st.args.max_body_bytes).await?;
    let (chat, mut p) = request::read(&obj, &st.sampling_defaults, false)?;
    // Any model name: this server has one model, and Anthropic clients name theirs in many
    // places (background and subagent models); the answer names the served one.
    if let Some(m) = p.model.as_deref().filter(|m| *m != st.model.id) {
        tracing::debug!(requested = m, served = %st.model.id, "messages: serving the one model for another name");
    }
    let prepared = st.text.prepare(&chat).map_err(|e| request::anthropic_names(e.into()))?;
    let sampling = super::format::constrained(&st, p.format.take(), &prepared, p.sampling.clone(), "output_config.format")?;
    let prompt_len = prepared.prompt_ids.len();
    let max = max_tokens(&st, Some(p.max_tokens), prompt_len, "messages")?;
    let id = new_id("msg");
    let job = single_chat_job(&st, &prepared, &id, max, sampling, p.stop_sequences.clone());
    let log = RequestLog::new(id.clone(), "messages", started, prompt_len as u32);
    let mut run = Run::start(&st, log, vec![job])?;
    let timeout = st.args.timeout();
    let deadline = timeout.map(|t| started + t);
    let model = st.model.id.clone();

    if p.stream {
        let enc = stream::MessageEncoder::new(id, model, prompt_len as u32);
        return super::sse::start(run, Box::new(enc), deadline, timeout).await;
    }

    // The answer's blocks come from the events a stream would carry, so both are the same.
    let mut enc = stream::MessageEncoder::new(id.clone(), model.clone(), prompt_len as u32);
    let events = run_to_end(&mut run, &mut enc, deadline, timeout, "message").await?;
    let last = enc.finish(&run.usage);
    let delta = &last[0]["delta"];
    let body = json!({
        "id": id, "type": "message", "role": "assistant", "model": model, "content": stream::assemble(&events),
        "stop_reason": delta["stop_reason"], "stop_sequence": delta["stop_sequence"], "usage": usage_json(&run.usage),
    });
    Ok(super::error::json_response(StatusCode::OK, &body))
}

/// Anthropic's `stop_reason` for how the choice ended.
pub fn stop_reason(end: &ChoiceEnd) -> &'static str {
    match end.reason {
        "tool_calls" => "tool_use",
        "length" => "max_tokens",
        _ if end.stop_sequence.is_some() => "stop_sequence",
        _ => "end_turn",
    }
}

/// Anthropic's `usage`: `input_tokens` counts the prompt tokens not read from the prefix cache.
pub fn usage_json(u: &Usage) -> Json {
    json!({
        "input_tokens": u.prompt_tokens.saturating_sub(u.cached_tokens),
        "output_tokens": u.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
    })
}

/// The arguments' JSON text as an object (the parser writes an object; anything else is
/// wrapped so the block stays valid).
pub fn input_object(arguments: &str) -> Json {
    match serde_json::from_str::<Json>(arguments) {
        Ok(v @ Json::Object(_)) => v,
        Ok(v) => json!({"value": v}),
        Err(_) => json!({"raw": arguments}),
    }
}
