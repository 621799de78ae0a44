//! `POST /v1/completions`: one or several prompts (string or token ids), `n` choices each;
//! choice `index` = prompt index × n + i.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value as Json, json};

use super::body::json_object;
use super::common::{check_model, choice_sampling, completion_logprobs, max_tokens, next_update, usage_json};
use super::error::ApiError;
use super::params::{Endpoint, Fields, PromptInput, common, prompts};
use super::run::{ChoiceJob, ChoiceKind, LogprobEntry, RequestLog, Run, Update};
use super::sse::{self, ChunkEncoder};
use super::state::{AppState, new_id, unix_now};
use crate::engine::{GenerationRequest, Usage};
use crate::text::output::Delta;
use crate::text::tokenizer::Tokenizer;

pub async fn handler(State(st): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match completions(st, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// Tokenizes completion prompts. The client writes the whole prompt here, so special-token
/// texts become their ids (as in llama.cpp and vLLM); BOS is added when the vocabulary asks.
pub fn tokenize_prompts(st: &AppState, inputs: Vec<PromptInput>, key: &str) -> Result<Vec<Vec<u32>>, ApiError> {
    let tok = st.text.tokenizer();
    inputs
        .into_iter()
        .map(|p| match p {
            PromptInput::Tokens(t) => Ok(t),
            PromptInput::Text(s) => tok
                .encode_trusted(&s)
                .map(|ids| if ids.is_empty() { ids } else { tok.with_bos(ids) })
                .map_err(|e| ApiError::invalid(key, e.to_string())),
        })
        .collect()
}

async fn completions(st: AppState, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let started = Instant::now();
    let obj = json_object(&headers, body, st.args.max_body_bytes).await?;
    let mut f = Fields::new(&obj);
    let vocab = st.text.tokenizer().vocab_size();
    let p = common(&mut f, Endpoint::Completions, &st.sampling_defaults, st.args.max_n, vocab)?;
    check_model(&st, p.model.as_deref())?;
    if f.bool("echo")? == Some(true) {
        return Err(ApiError::unsupported("echo", "`echo: true` is not supported"));
    }
    if let Some(s) = f.string("suffix")?
        && !s.is_empty()
    {
        return Err(ApiError::unsupported("suffix", "`suffix` (fill-in-the-middle) is not supported by this model"));
    }
    // Structured outputs on raw prompts: the document starts with the first generated token.
    let format = super::format::chat_response_format(f.get("response_format"))?;
    let mut sampling = p.sampling.clone();
    sampling.constraint = format.map(|g| st.constraint(g, false, crate::constrain::Mode::Document));
    let inputs = prompts(f.get("prompt"), "prompt", vocab)?;
    let unknown = f.unknown();
    let id = new_id("cmpl");
    if !unknown.is_empty() {
        tracing::debug!(id = %id, fields = ?unknown, "ignoring unknown request fields");
    }
    let multi = inputs.len() > 1;
    let prompt_ids = tokenize_prompts(&st, inputs, "prompt")?;
    let stop_ids = if p.ignore_eos { Vec::new() } else { st.text.tokenizer().eog_ids() };
    let mut jobs = Vec::new();
    for (pi, ids) in prompt_ids.iter().enumerate() {
        let param = if multi { format!("prompt[{pi}]") } else { "prompt".to_string() };
        let max = max_tokens(&st, p.max_tokens, ids.len(), &param)?;
        for i in 0..p.n {
            let index = pi as u32 * p.n + i;
            jobs.push(ChoiceJob {
                index,
                prompt_index: pi,
                request: GenerationRequest {
                    request_id: format!("{id}-{index}"),
                    prompt: ids.clone(),
                    max_tokens: max,
                    sampling: choice_sampling(&sampling, i),
                    stop_token_ids: stop_ids.clone(),
                },
                stop: p.stop.clone(),
                kind: ChoiceKind::Text,
            });
        }
    }
    let total = jobs.len();
    let log = RequestLog::new(id.clone(), "completions", started, prompt_ids.iter().map(|p| p.len() as u32).sum());
    let mut run = Run::start(&st, log, jobs)?;
    let timeout = st.args.timeout();
    let deadline = timeout.map(|t| started + t);
    let tok = st.text.tokenizer().clone();
    let want_logprobs = p.sampling.logprobs;
    let with_top = p.sampling.top_logprobs > 0;
    let mut enc = CompletionEncoder {
        id,
        created: unix_now(),
        model: st.model.id.clone(),
        tok,
        include_usage: p.include_usage,
        want_logprobs,
        with_top,
        offsets: vec![0; total],
    };

    if p.stream {
        return sse::start(run, Box::new(enc), deadline, timeout).await;
    }

    let mut texts = vec![String::new(); total];
    let mut reasons = vec!["stop"; total];
    let mut lps: Vec<Vec<LogprobEntry>> = vec![Vec::new(); total];
    while let Some(u) = next_update(&mut run, deadline, timeout).await {
        let u = u?;
        for d in &u.deltas {
            if let Delta::Content(t) = d {
                texts[u.slot].push_str(t);
            }
        }
        lps[u.slot].extend(u.logprobs);
        if let Some(end) = u.end {
            reasons[u.slot] = end.reason;
        }
        if run.all_done() {
            break;
        }
    }
    let choices: Vec<Json> = (0..total)
        .map(|i| {
            let logprobs =
                if want_logprobs { completion_logprobs(&enc.tok, &lps[i], &mut enc.offsets[i], with_top) } else { Json::Null };
            json!({"index": i, "text": texts[i], "logprobs": logprobs, "finish_reason": reasons[i]})
        })
        .collect();
    let body = json!({
        "id": enc.id, "object": "text_completion", "created": enc.created, "model": enc.model,
        "choices": choices, "usage": usage_json(&run.usage),
    });
    Ok(super::error::json_response(StatusCode::OK, &body))
}

struct CompletionEncoder {
    id: String,
    created: u64,
    model: String,
    tok: Arc<Tokenizer>,
    include_usage: bool,
    want_logprobs: bool,
    with_top: bool,
    offsets: Vec<usize>,
}

impl CompletionEncoder {
    fn chunk(&self, index: u32, text: &str, logprobs: Json, finish: Option<&str>) -> Json {
        let mut c = json!({
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        });
        if self.include_usage {
            c["usage"] = Json::Null;
        }
        c
    }
}

impl ChunkEncoder for CompletionEncoder {
    fn start(&mut self) -> Vec<Json> {
        Vec::new()
    }

    fn update(&mut self, u: Update) -> Result<Vec<Json>, ApiError> {
        let text: String = u
            .deltas
            .iter()
            .filter_map(|d| if let Delta::Content(t) = d { Some(t.as_str()) } else { None })
            .collect();
        let lp = if self.want_logprobs && !u.logprobs.is_empty() {
            completion_logprobs(&self.tok, &u.logprobs, &mut self.offsets[u.slot], self.with_top)
        } else {
            Json::Null
        };
        let mut out = Vec::new();
        match &u.end {
            // The last text rides on the chunk that carries finish_reason.
            Some(end) => out.push(self.chunk(u.index, &text, lp, Some(end.reason))),
            None if !text.is_empty() => out.push(self.chunk(u.index, &text, lp, None)),
            None => {}
        }
        Ok(out)
    }

    fn finish(&mut self, usage: &Usage) -> Vec<Json> {
        self.include_usage.then(|| {
            json!({
                "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [], "usage": usage_json(usage),
            })
        })
        .into_iter()
        .collect()
    }
}
