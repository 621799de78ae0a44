//! `POST /v1/chat/completions`.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value as Json, json};

use super::body::json_object;
use super::common::{chat_logprobs, check_model, choice_sampling, max_tokens, next_update, usage_json};
use super::error::ApiError;
use super::params::{Endpoint, Fields, common, type_name};
use super::run::{ChoiceJob, ChoiceKind, RequestLog, Run, Update};
use super::sse::{self, ChunkEncoder};
use super::state::{AppState, new_id, unix_now};
use crate::engine::{GenerationRequest, Usage};
use crate::text::output::{Delta, Finished};
use crate::text::request::ChatText;
use crate::text::tokenizer::Tokenizer;

pub async fn handler(State(st): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match chat(st, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

fn reject_if_present(f: &mut Fields<'_>, key: &'static str, why: &str) -> Result<(), ApiError> {
    match f.get(key) {
        Some(_) => Err(ApiError::unsupported(key, why)),
        None => Ok(()),
    }
}

async fn chat(st: AppState, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let started = Instant::now();
    let obj = json_object(&headers, body, st.args.max_body_bytes).await?;
    let mut f = Fields::new(&obj);
    let vocab = st.text.tokenizer().vocab_size();
    let p = common(&mut f, Endpoint::Chat, &st.sampling_defaults, st.args.max_n, vocab)?;
    check_model(&st, p.model.as_deref())?;

    let format = super::format::chat_response_format(f.get("response_format"))?;
    reject_if_present(&mut f, "functions", "the legacy `functions` field is not supported; use `tools`")?;
    reject_if_present(&mut f, "function_call", "the legacy `function_call` field is not supported; use `tool_choice`")?;
    reject_if_present(&mut f, "audio", "audio output is not supported")?;
    reject_if_present(&mut f, "prediction", "predicted outputs are not supported")?;
    reject_if_present(&mut f, "web_search_options", "web search is not supported")?;
    if let Some(m) = f.get("modalities")
        && m.as_array().is_some_and(|a| a.iter().any(|x| x.as_str() != Some("text")))
    {
        return Err(ApiError::unsupported("modalities", "only `text` output is supported"));
    }
    let messages = match f.get("messages") {
        Some(Json::Array(a)) => a.clone(),
        Some(v) => return Err(ApiError::invalid("messages", format!("must be an array, got {}", type_name(v)))),
        None => return Err(ApiError::invalid("messages", "is required")),
    };
    let chat_text = ChatText {
        messages,
        tools: f.get("tools").cloned(),
        tool_choice: f.get("tool_choice").cloned(),
        parallel_tool_calls: f.bool("parallel_tool_calls")?,
        chat_template_kwargs: f.get("chat_template_kwargs").cloned(),
        reasoning_format: f.string("reasoning_format")?.map(str::to_string),
    };
    let unknown = f.unknown();
    let id = new_id("chatcmpl");
    if !unknown.is_empty() {
        tracing::debug!(id = %id, fields = ?unknown, "ignoring unknown request fields");
    }
    let prepared = st.text.prepare(&chat_text)?;
    let sampling = super::format::constrained(&st, format, &prepared, p.sampling.clone(), "response_format")?;
    let max = max_tokens(&st, p.max_tokens, prepared.prompt_ids.len(), "messages")?;
    let stop_ids = if p.ignore_eos { Vec::new() } else { st.text.tokenizer().eog_ids() };
    let want_logprobs = p.sampling.logprobs;
    let jobs = (0..p.n)
        .map(|i| ChoiceJob {
            index: i,
            prompt_index: 0,
            request: GenerationRequest {
                request_id: format!("{id}-{i}"),
                prompt: prepared.prompt_ids.clone(),
                max_tokens: max,
                sampling: choice_sampling(&sampling, i),
                stop_token_ids: stop_ids.clone(),
            },
            stop: p.stop.clone(),
            kind: ChoiceKind::Chat(Box::new(st.text.output_parser(&prepared))),
        })
        .collect();
    let log = RequestLog::new(id.clone(), "chat", started, prepared.prompt_ids.len() as u32);
    let mut run = Run::start(&st, log, jobs)?;
    let timeout = st.args.timeout();
    let deadline = timeout.map(|t| started + t);
    let meta = Meta { id, created: unix_now(), model: st.model.id.clone() };
    let tok = st.text.tokenizer().clone();

    if p.stream {
        let enc = ChatEncoder { meta, tok, n: p.n, include_usage: p.include_usage, want_logprobs };
        return sse::start(run, Box::new(enc), deadline, timeout).await;
    }

    let mut ends: Vec<Option<Finished>> = (0..p.n).map(|_| None).collect();
    let mut reasons: Vec<&'static str> = vec!["stop"; p.n as usize];
    let mut lps: Vec<Vec<super::run::LogprobEntry>> = vec![Vec::new(); p.n as usize];
    while let Some(u) = next_update(&mut run, deadline, timeout).await {
        let u = u?;
        lps[u.slot].extend(u.logprobs);
        if let Some(end) = u.end {
            reasons[u.slot] = end.reason;
            ends[u.slot] = end.chat;
        }
        if run.all_done() {
            break;
        }
    }
    let mut choices = Vec::new();
    for (i, fin) in ends.into_iter().enumerate() {
        let fin = fin.ok_or_else(|| ApiError::internal("a choice ended without a result"))?;
        if let Some(err) = &fin.tool_choice_error {
            return Err(tool_choice_error(&err.0));
        }
        let mut msg = serde_json::Map::new();
        msg.insert("role".into(), json!("assistant"));
        let content = if fin.content.is_empty() && !fin.tool_calls.is_empty() { Json::Null } else { json!(fin.content) };
        msg.insert("content".into(), content);
        if !fin.reasoning_content.is_empty() {
            msg.insert("reasoning_content".into(), json!(fin.reasoning_content));
        }
        if !fin.tool_calls.is_empty() {
            let calls: Vec<Json> = fin
                .tool_calls
                .iter()
                .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
                .collect();
            msg.insert("tool_calls".into(), Json::Array(calls));
        }
        let logprobs = if want_logprobs { chat_logprobs(&tok, &lps[i]) } else { Json::Null };
        choices.push(json!({"index": i, "message": msg, "logprobs": logprobs, "finish_reason": reasons[i]}));
    }
    let body = json!({
        "id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
        "choices": choices, "usage": usage_json(&run.usage),
    });
    Ok(super::error::json_response(StatusCode::OK, &body))
}

/// `tool_choice` demanded a call the model did not make: say so instead of pretending.
pub(super) fn tool_choice_error(msg: &str) -> ApiError {
    let mut e = ApiError::new(StatusCode::BAD_GATEWAY, "model_error", msg);
    e.param = Some("tool_choice".into());
    e.code = Some("tool_choice_unmet");
    e
}

struct Meta {
    id: String,
    created: u64,
    model: String,
}

struct ChatEncoder {
    meta: Meta,
    tok: Arc<Tokenizer>,
    n: u32,
    include_usage: bool,
    want_logprobs: bool,
}

impl ChatEncoder {
    fn chunk(&self, index: u32, delta: Json, logprobs: Json, finish: Option<&str>) -> Json {
        let mut c = json!({
            "id": self.meta.id, "object": "chat.completion.chunk", "created": self.meta.created,
            "model": self.meta.model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        });
        if self.include_usage {
            c["usage"] = Json::Null;
        }
        c
    }
}

impl ChunkEncoder for ChatEncoder {
    fn start(&mut self) -> Vec<Json> {
        (0..self.n).map(|i| self.chunk(i, json!({"role": "assistant", "content": ""}), Json::Null, None)).collect()
    }

    fn update(&mut self, u: Update) -> Result<Vec<Json>, ApiError> {
        let mut out = Vec::new();
        let mut lp = if self.want_logprobs && !u.logprobs.is_empty() { Some(chat_logprobs(&self.tok, &u.logprobs)) } else { None };
        let mut deltas = u.deltas.into_iter().peekable();
        while let Some(d) = deltas.next() {
            let delta = match d {
                Delta::Reasoning(t) => json!({"reasoning_content": t}),
                Delta::Content(t) => json!({"content": t}),
                Delta::ToolCallStart { index, id, name } => {
                    // Merge the call's first argument text into its opening delta.
                    let mut args = String::new();
                    while let Some(Delta::ToolCallArguments { index: i, chunk }) = deltas.peek() {
                        if *i != index {
                            break;
                        }
                        args.push_str(chunk);
                        deltas.next();
                    }
                    json!({"tool_calls": [{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": args}}]})
                }
                Delta::ToolCallArguments { index, chunk } => {
                    json!({"tool_calls": [{"index": index, "function": {"arguments": chunk}}]})
                }
            };
            out.push(self.chunk(u.index, delta, lp.take().unwrap_or(Json::Null), None));
        }
        if let Some(end) = u.end {
            if let Some(err) = end.chat.as_ref().and_then(|f| f.tool_choice_error.as_ref()) {
                return Err(tool_choice_error(&err.0));
            }
            out.push(self.chunk(u.index, json!({}), lp.take().unwrap_or(Json::Null), Some(end.reason)));
        }
        Ok(out)
    }

    fn finish(&mut self, usage: &Usage) -> Vec<Json> {
        self.include_usage.then(|| {
            json!({
                "id": self.meta.id, "object": "chat.completion.chunk", "created": self.meta.created,
                "model": self.meta.model, "choices": [], "usage": usage_json(usage),
            })
        })
        .into_iter()
        .collect()
    }
}
