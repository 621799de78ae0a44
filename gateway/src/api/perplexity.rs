//! `POST /v1/perplexity`: teacher-forced scoring of one or more prompts.
//!
//! Response: per prompt the token ids, their texts, `logprobs[i]` = ln p(token[i] | token[..i])
//! (`null` for the first token), total negative log-likelihood and perplexity
//! = exp(nll / scored tokens).

use std::time::Instant;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::future::join_all;
use serde_json::{Value as Json, json};

use super::body::json_object;
use super::common::check_model;
use super::completions::tokenize_prompts;
use super::error::ApiError;
use super::params::{Fields, prompts};
use super::state::{AppState, new_id, unix_now};

pub async fn handler(State(st): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match perplexity(st, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn perplexity(st: AppState, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let started = Instant::now();
    let obj = json_object(&headers, body, st.args.max_body_bytes).await?;
    let mut f = Fields::new(&obj);
    check_model(&st, f.string("model")?)?;
    let vocab = st.text.tokenizer().vocab_size();
    // `prompt` like completions; `input` accepted as an alias.
    let key = if f.get("prompt").is_some() { "prompt" } else { "input" };
    let inputs = prompts(f.get(key).or_else(|| f.get("prompt")), "prompt", vocab)?;
    let unknown = f.unknown();
    let id = new_id("ppl");
    if !unknown.is_empty() {
        tracing::debug!(id = %id, fields = ?unknown, "ignoring unknown request fields");
    }
    let multi = inputs.len() > 1;
    let all = tokenize_prompts(&st, inputs, "prompt")?;
    let ctx = st.model.context_length as usize;
    for (i, t) in all.iter().enumerate() {
        let param = if multi { format!("prompt[{i}]") } else { "prompt".into() };
        if t.len() < 2 {
            return Err(ApiError::invalid(param, format!("needs at least 2 tokens to score, got {}", t.len())));
        }
        if t.len() > ctx {
            let mut e =
                ApiError::invalid(param, format!("has {} tokens; the model's context length is {ctx}", t.len()));
            e.code = Some("context_length_exceeded");
            return Err(e);
        }
    }
    let futs = all.iter().enumerate().map(|(i, t)| st.backend.score(format!("{id}-{i}"), t.clone()));
    let work = join_all(futs);
    let results = match st.args.timeout() {
        Some(t) => tokio::time::timeout(t, work).await.map_err(|_| ApiError::timeout(t.as_secs_f64()))?,
        None => work.await,
    };
    let tok = st.text.tokenizer();
    let mut data = Vec::new();
    let (mut prompt_tokens, mut cached) = (0u64, 0u64);
    for (i, (tokens, r)) in all.iter().zip(results).enumerate() {
        let r = r?;
        if r.logprobs.len() + 1 != tokens.len() {
            return Err(ApiError::internal(format!(
                "scoring returned {} logprobs for {} tokens",
                r.logprobs.len(),
                tokens.len()
            )));
        }
        let nll: f64 = -r.logprobs.iter().map(|&x| x as f64).sum::<f64>();
        let n = r.logprobs.len() as f64;
        let mut lps = vec![Json::Null];
        lps.extend(r.logprobs.iter().map(|&x| json!(x)));
        let texts: Vec<String> = tokens.iter().map(|&t| String::from_utf8_lossy(tok.token_bytes(t)).into_owned()).collect();
        prompt_tokens += tokens.len() as u64;
        cached += r.cached_tokens as u64;
        data.push(json!({
            "index": i, "tokens": tokens, "token_strings": texts, "logprobs": lps,
            "nll": nll, "mean_nll": nll / n, "perplexity": (nll / n).exp(), "scored_tokens": n as u64,
            "cached_tokens": r.cached_tokens,
        }));
    }
    st.metrics.prompt(prompt_tokens, cached);
    tracing::info!(target: "minimax::request", id = %id, endpoint = "perplexity", prompt_tokens, cached_tokens = cached,
        total_ms = format_args!("{:.1}", started.elapsed().as_secs_f64() * 1000.0), finish_reason = "scored", "request");
    let body = json!({
        "id": id, "object": "perplexity", "created": unix_now(), "model": st.model.id, "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "prompt_tokens_details": {"cached_tokens": cached}},
    });
    Ok(super::error::json_response(StatusCode::OK, &body))
}
