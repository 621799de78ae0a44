//! `POST /v1/responses`: the OpenAI Responses API, the protocol Codex CLI speaks (it dropped
//! chat completions for custom providers in 2026). Stateless: every request carries its whole
//! input (`store` has no effect; `previous_response_id` is refused). The request is read into
//! the chat path's form (`request.rs`) and runs on the same engine, template and parsers; the
//! answer is a response object whose output items (`reasoning`, `message`, `function_call`)
//! come from the same events a stream carries (`stream.rs`). Errors are the OpenAI error
//! bodies. See docs/API.md "Responses API".

pub mod request;
pub mod stream;

use std::time::Instant;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use super::body::json_object;
use super::common::{max_tokens, run_to_end, single_chat_job};
use super::error::ApiError;
use super::run::{RequestLog, Run};
use super::sse::ChunkEncoder;
use super::state::{AppState, new_id, unix_now};

pub async fn handler(State(st): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match responses(st, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn responses(st: AppState, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let started = Instant::now();
    let obj = json_object(&headers, body, st.args.max_body_bytes).await?;
    let (chat, mut p) = request::read(&obj, &st.sampling_defaults)?;
    // Any model name: agents name theirs in their own settings; the answer names the served one.
    if let Some(m) = p.model.as_deref().filter(|m| *m != st.model.id) {
        tracing::debug!(requested = m, served = %st.model.id, "responses: serving the one model for another name");
    }
    let prepared = st.text.prepare(&chat)?;
    let sampling = super::format::constrained(&st, p.format.take(), &prepared, p.sampling.clone(), "text.format")?;
    let prompt_len = prepared.prompt_ids.len();
    let max = max_tokens(&st, p.max_output_tokens, prompt_len, "input")?;
    let id = new_id("resp");
    let job = single_chat_job(&st, &prepared, &id, max, sampling, Vec::new());
    let log = RequestLog::new(id.clone(), "responses", started, prompt_len as u32);
    let mut run = Run::start(&st, log, vec![job])?;
    let timeout = st.args.timeout();
    let deadline = timeout.map(|t| started + t);
    let stream = p.stream;
    let mut enc = stream::ResponseEncoder::new(id, unix_now(), st.model.id.clone(), p);

    if stream {
        return super::sse::start(run, Box::new(enc), deadline, timeout).await;
    }
    run_to_end(&mut run, &mut enc, deadline, timeout, "response").await?;
    let last = enc.finish(&run.usage);
    Ok(super::error::json_response(StatusCode::OK, &last[0]["response"]))
}
