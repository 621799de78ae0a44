//! The boundary between the HTTP layer and the engine (scheduler + ranks): what a request asks
//! for and what comes back, token by token. The HTTP layer owns text (templates, stop strings,
//! parsing); the engine owns tokens, pages, batching and sampling.

use std::collections::HashMap;
use std::sync::Arc;

use crate::constrain::ConstraintSpec;

/// Sampling settings of one request, already validated by the API layer.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: u32,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// 1 = off.
    pub repetition_penalty: f32,
    pub logit_bias: HashMap<u32, f32>,
    /// Same seed, same output. `None`: drawn from the OS.
    pub seed: Option<u64>,
    /// Return the sampled token's logprob.
    pub logprobs: bool,
    /// 0..=20 top alternatives per token.
    pub top_logprobs: u32,
    /// Structured outputs: the document the output must be (`None`: free text).
    pub constraint: Option<Arc<ConstraintSpec>>,
}

impl Default for SamplingParams {
    /// MiniMax's recommended defaults: temperature 1.0, top_p 0.95, top_k 40.
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: HashMap::new(),
            seed: None,
            logprobs: false,
            top_logprobs: 0,
            constraint: None,
        }
    }
}

/// One generation: a tokenized prompt and how to continue it.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationRequest {
    /// For logs and metrics.
    pub request_id: String,
    pub prompt: Vec<u32>,
    /// Upper bound on generated tokens; the engine also stops at the context length.
    pub max_tokens: u32,
    pub sampling: SamplingParams,
    /// Tokens that end generation (the model's end-of-generation set); not emitted as text.
    pub stop_token_ids: Vec<u32>,
}

/// Log-probabilities of a sampled token (from the raw model distribution).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    /// The top alternatives, best first.
    pub top: Vec<(u32, f32)>,
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token was sampled.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
}

/// Token counts of a finished generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
    pub completion_tokens: u32,
}

/// Timings of a finished generation, for the per-request log line and metrics.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct Timings {
    pub queue_ms: f64,
    pub prefill_ms: f64,
    pub ttft_ms: f64,
    pub decode_ms: f64,
}

/// What a generation stream yields, in order: one `Started` when the request is admitted
/// (unless it fails first), zero or more `Token`s, then exactly one `Finished` or `Failed`.
#[derive(Clone, Debug, PartialEq)]
pub enum GenEvent {
    /// Admitted into the running batch; `cached_tokens` prompt tokens come from the prefix
    /// cache. Sent first so a caller that stops early (a stop string) can still report them.
    Started { cached_tokens: u32 },
    Token { id: u32, logprob: Option<TokenLogprob> },
    Finished { reason: FinishReason, usage: Usage, timings: Timings },
    Failed(EngineError),
}

/// Errors the API layer maps to HTTP statuses.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// 429.
    #[error("the server is busy: request queue is full ({0} waiting)")]
    QueueFull(usize),
    /// 503: ranks loading, restarting or failed.
    #[error("the model is not ready: {0}")]
    NotReady(String),
    /// 503: a rank died or the world broke while this request ran.
    #[error("a rank failed while serving this request: {0}")]
    RankFailure(String),
    /// 400.
    #[error("prompt has {prompt} tokens, the context length is {context}")]
    PromptTooLong { prompt: usize, context: usize },
    /// 400.
    #[error("{0}")]
    InvalidRequest(String),
    /// 500: ranks disagreed about a cache length; the sequence was dropped.
    #[error("KV cache disagreement: {0}")]
    CacheMismatch(String),
    /// 500: a bug of ours.
    #[error("internal error: {0}")]
    Internal(String),
}

/// Result of teacher-forced scoring (`/v1/perplexity`).
#[derive(Clone, Debug, PartialEq)]
pub struct ScoreResult {
    /// ln p(token[i] | token[..i]) for i >= 1 (the first token is unscored).
    pub logprobs: Vec<f32>,
    pub cached_tokens: u32,
}

/// Each rank's state, for `/health`.
#[derive(Clone, Debug, PartialEq)]
pub struct RankHealth {
    pub rank: u32,
    /// "loading", "ready", "restarting", "failed", ...
    pub state: String,
    /// 0..1 while loading.
    pub progress: f32,
    pub detail: String,
}
