//! Running the generations of one HTTP request (several prompts × `n` choices) and turning
//! their token events into text deltas: detokenize → stop strings → (chat) reasoning and
//! tool-call parsing. Streaming and non-streaming responses consume the same updates, so their
//! outputs are identical.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use futures_util::Stream;

use super::backend::EventStream;
use super::error::ApiError;
use super::state::AppState;
use super::stop::StopMatcher;
use crate::engine::{EngineError, FinishReason as EngineFinish, GenEvent, GenerationRequest, TokenLogprob, Usage};
use crate::text::detok::IncrementalDecoder;
use crate::text::format::ModelFormat;
use crate::text::output::{Delta, Finished, OutputParser, StopCause};
use crate::text::tokenizer::{TokenType, Tokenizer};

/// One sampled token's logprobs, for the response's `logprobs`.
#[derive(Debug, Clone, PartialEq)]
pub struct LogprobEntry {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// How one choice's text is post-processed.
pub enum ChoiceKind {
    /// Completions: plain text.
    Text,
    /// Chat: reasoning split and tool-call parsing.
    Chat(Box<OutputParser>),
}

/// One choice to run.
pub struct ChoiceJob {
    /// The response's choice index.
    pub index: u32,
    /// Which prompt of a batch this choice belongs to (usage counts each prompt once).
    pub prompt_index: usize,
    pub request: GenerationRequest,
    pub stop: Vec<String>,
    pub kind: ChoiceKind,
}

/// How a choice ended.
#[derive(Debug)]
pub struct ChoiceEnd {
    /// OpenAI `finish_reason`.
    pub reason: &'static str,
    pub usage: Usage,
    /// Chat only: the parser's final state (content, reasoning, calls, tool_choice verdict).
    pub chat: Option<Finished>,
    /// The stop string that ended the choice, if one did.
    pub stop_sequence: Option<String>,
}

/// A step of one choice.
#[derive(Debug)]
pub struct Update {
    /// Position of the choice in the request's job list.
    pub slot: usize,
    pub index: u32,
    pub deltas: Vec<Delta>,
    /// Logprobs of tokens consumed since the last update of this choice that carried any.
    pub logprobs: Vec<LogprobEntry>,
    pub end: Option<ChoiceEnd>,
}

impl Update {
    pub fn is_empty(&self) -> bool {
        self.deltas.is_empty() && self.end.is_none()
    }
}

struct Choice {
    index: u32,
    prompt_index: usize,
    prompt_tokens: u32,
    stream: Option<EventStream>,
    stop: StopMatcher,
    decoder: IncrementalDecoder,
    parser: Option<Box<OutputParser>>,
    pending_lp: Vec<LogprobEntry>,
    tokens: u32,
    /// Prompt tokens served from the prefix cache (from the engine's `Started`).
    cached_tokens: u32,
    last_token_at: Option<Instant>,
    done: bool,
}

/// Per-request accounting, logged once when the request ends (also on disconnect).
pub struct RequestLog {
    pub id: String,
    pub endpoint: &'static str,
    pub started: Instant,
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    pub completion_tokens: u32,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    pub ttft_ms: Option<f64>,
    pub finish: Vec<&'static str>,
    pub error: Option<String>,
    pub metrics: Option<Arc<super::metrics::Metrics>>,
}

impl RequestLog {
    /// The log of a request that has not produced anything yet.
    pub fn new(id: String, endpoint: &'static str, started: Instant, prompt_tokens: u32) -> Self {
        Self {
            id,
            endpoint,
            started,
            prompt_tokens,
            cached_tokens: 0,
            completion_tokens: 0,
            prefill_ms: 0.0,
            decode_ms: 0.0,
            ttft_ms: None,
            finish: Vec::new(),
            error: None,
            metrics: None,
        }
    }
}

impl Drop for RequestLog {
    fn drop(&mut self) {
        let finish = if self.finish.is_empty() {
            if self.error.is_some() { "error".to_string() } else { "cancelled".to_string() }
        } else {
            self.finish.join(",")
        };
        if finish == "cancelled"
            && let Some(m) = &self.metrics
        {
            m.cancelled();
        }
        let decode_s = self.decode_ms / 1000.0;
        let tok_s = if decode_s > 0.0 { self.completion_tokens as f64 / decode_s } else { 0.0 };
        tracing::info!(
            target: "minimax::request",
            id = %self.id,
            endpoint = self.endpoint,
            prompt_tokens = self.prompt_tokens,
            cached_tokens = self.cached_tokens,
            prefill_ms = format_args!("{:.1}", self.prefill_ms),
            decode_tokens = self.completion_tokens,
            decode_tok_s = format_args!("{:.1}", tok_s),
            ttft_ms = format_args!("{:.1}", self.ttft_ms.unwrap_or(0.0)),
            total_ms = format_args!("{:.1}", self.started.elapsed().as_secs_f64() * 1000.0),
            finish_reason = %finish,
            error = self.error.as_deref().unwrap_or(""),
            "request"
        );
    }
}

/// The running generations of one request.
pub struct Run {
    choices: Vec<Choice>,
    tokenizer: Arc<Tokenizer>,
    format: ModelFormat,
    state: AppState,
    next_poll: usize,
    prompt_counted: Vec<bool>,
    pub log: RequestLog,
    pub usage: Usage,
    failed: bool,
}

impl Run {
    /// Submits every job; the first refusal fails the whole request (the others are cancelled).
    pub fn start(state: &AppState, log: RequestLog, jobs: Vec<ChoiceJob>) -> Result<Run, ApiError> {
        let mut choices = Vec::with_capacity(jobs.len());
        let mut log = log;
        let n_prompts = jobs.iter().map(|j| j.prompt_index + 1).max().unwrap_or(0);
        for job in jobs {
            let prompt_tokens = job.request.prompt.len() as u32;
            let stream = match state.backend.generate(job.request) {
                Ok(s) => s,
                Err(e) => {
                    log.error = Some(e.to_string());
                    return Err(e.into());
                }
            };
            choices.push(Choice {
                index: job.index,
                prompt_index: job.prompt_index,
                prompt_tokens,
                stream: Some(stream),
                stop: StopMatcher::new(job.stop),
                decoder: IncrementalDecoder::new(),
                parser: match job.kind {
                    ChoiceKind::Text => None,
                    ChoiceKind::Chat(p) => Some(p),
                },
                pending_lp: Vec::new(),
                tokens: 0,
                cached_tokens: 0,
                last_token_at: None,
                done: false,
            });
        }
        log.metrics = Some(state.metrics.clone());
        Ok(Run {
            choices,
            tokenizer: state.text.tokenizer().clone(),
            format: state.text.format().clone(),
            state: state.clone(),
            next_poll: 0,
            prompt_counted: vec![false; n_prompts],
            log,
            usage: Usage::default(),
            failed: false,
        })
    }

    pub fn len(&self) -> usize {
        self.choices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.choices.is_empty()
    }

    /// Text a generated token contributes: none for end-of-generation tokens and for control
    /// tokens other than the reasoning/tool-call tags the parsers need.
    fn token_text_bytes(&self, id: u32) -> &[u8] {
        if self.tokenizer.is_eog(id) {
            return &[];
        }
        let bytes = self.tokenizer.token_bytes(id);
        if self.tokenizer.token_type(id) == TokenType::Control
            && !self.format.meaningful_tags().iter().any(|t| t.as_bytes() == bytes)
        {
            return &[];
        }
        bytes
    }

    fn on_event(&mut self, slot: usize, ev: GenEvent) -> Result<Update, ApiError> {
        let now = Instant::now();
        let mut deltas = Vec::new();
        let mut end = None;
        match ev {
            GenEvent::Started { cached_tokens } => {
                self.choices[slot].cached_tokens = cached_tokens;
            }
            GenEvent::Token { id, logprob } => {
                let bytes = self.token_text_bytes(id).to_vec();
                let metrics = self.state.metrics.clone();
                let started = self.log.started;
                let c = &mut self.choices[slot];
                c.tokens += 1;
                match c.last_token_at {
                    None => {
                        let ttft = now.duration_since(started).as_secs_f64();
                        metrics.ttft(ttft);
                        if self.log.ttft_ms.is_none() {
                            self.log.ttft_ms = Some(ttft * 1000.0);
                        }
                    }
                    Some(t) => metrics.inter_token(now.duration_since(t).as_secs_f64()),
                }
                c.last_token_at = Some(now);
                if let Some(TokenLogprob { logprob, top }) = logprob {
                    c.pending_lp.push(LogprobEntry { id, logprob, top });
                }
                let text = c.decoder.push(&bytes);
                let out = c.stop.push(&text);
                push_text(c, &out.text, &mut deltas);
                if out.stopped {
                    // Stop string: cancel the sequence; the engine's usage is not coming.
                    c.stream = None;
                    let usage = Usage { prompt_tokens: c.prompt_tokens, cached_tokens: c.cached_tokens, completion_tokens: c.tokens };
                    end = Some(self.finish_choice(slot, StopCause::StopSequence, usage, &mut deltas));
                }
            }
            GenEvent::Finished { reason, usage, timings } => {
                let c = &mut self.choices[slot];
                c.stream = None;
                let tail = c.decoder.finish();
                let out = c.stop.push(&tail);
                push_text(c, &out.text, &mut deltas);
                let rest = c.stop.finish();
                push_text(c, &rest, &mut deltas);
                let cause = if out.stopped {
                    StopCause::StopSequence
                } else {
                    match reason {
                        EngineFinish::Stop => StopCause::EndOfGeneration,
                        EngineFinish::Length => StopCause::Length,
                    }
                };
                if !self.prompt_counted[c.prompt_index] {
                    self.log.prefill_ms += timings.prefill_ms;
                }
                self.log.decode_ms = self.log.decode_ms.max(timings.decode_ms);
                end = Some(self.finish_choice(slot, cause, usage, &mut deltas));
            }
            GenEvent::Failed(e) => {
                self.fail(&e.to_string());
                return Err(e.into());
            }
        }
        let c = &mut self.choices[slot];
        let logprobs = if !deltas.is_empty() || end.is_some() { std::mem::take(&mut c.pending_lp) } else { Vec::new() };
        Ok(Update { slot, index: c.index, deltas, logprobs, end })
    }

    fn finish_choice(&mut self, slot: usize, cause: StopCause, usage: Usage, deltas: &mut Vec<Delta>) -> ChoiceEnd {
        let c = &mut self.choices[slot];
        c.done = true;
        let (reason, chat) = match c.parser.take() {
            Some(p) => {
                let fin = p.finish(cause);
                deltas.extend(fin.deltas.iter().cloned());
                (fin.finish_reason.as_str(), Some(fin))
            }
            None => (if cause == StopCause::Length { "length" } else { "stop" }, None),
        };
        // Usage: each prompt's tokens once (n > 1 shares the prompt), every choice's output.
        if !self.prompt_counted[c.prompt_index] {
            self.prompt_counted[c.prompt_index] = true;
            self.usage.prompt_tokens += usage.prompt_tokens;
            self.usage.cached_tokens += usage.cached_tokens;
            self.state.metrics.prompt(usage.prompt_tokens as u64, usage.cached_tokens as u64);
        }
        self.usage.completion_tokens += usage.completion_tokens;
        self.state.metrics.generated(usage.completion_tokens as u64);
        self.state.metrics.finished(reason);
        self.log.prompt_tokens = self.usage.prompt_tokens;
        self.log.cached_tokens = self.usage.cached_tokens;
        self.log.completion_tokens = self.usage.completion_tokens;
        self.log.finish.push(reason);
        if self.choices.iter().all(|c| c.done) {
            self.state.metrics.e2e(self.log.started.elapsed().as_secs_f64());
        }
        let stop_sequence = self.choices[slot].stop.matched().map(str::to_string);
        ChoiceEnd { reason, usage, chat, stop_sequence }
    }

    /// Cancels everything (drops the engine streams).
    pub fn fail(&mut self, why: &str) {
        self.failed = true;
        self.log.error = Some(why.to_string());
        for c in &mut self.choices {
            c.stream = None;
        }
    }

    pub fn all_done(&self) -> bool {
        self.failed || self.choices.iter().all(|c| c.done)
    }
}

fn push_text(c: &mut Choice, text: &str, deltas: &mut Vec<Delta>) {
    if text.is_empty() {
        return;
    }
    match &mut c.parser {
        Some(p) => deltas.extend(p.push_text(text)),
        None => match deltas.last_mut() {
            Some(Delta::Content(prev)) => prev.push_str(text),
            _ => deltas.push(Delta::Content(text.to_string())),
        },
    }
}

impl Stream for Run {
    type Item = Result<Update, ApiError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.failed {
            return Poll::Ready(None);
        }
        let n = this.choices.len();
        let mut live = false;
        for k in 0..n {
            let slot = (this.next_poll + k) % n;
            let Some(s) = this.choices[slot].stream.as_mut() else { continue };
            live = true;
            // `Started` carries bookkeeping only: absorb it here so that the first update a
            // caller sees is a token or the end (a refusal before any token stays a status).
            let mut cached = None;
            let polled = loop {
                match s.as_mut().poll_next(cx) {
                    Poll::Ready(Some(GenEvent::Started { cached_tokens })) => cached = Some(cached_tokens),
                    other => break other,
                }
            };
            if let Some(c) = cached {
                this.choices[slot].cached_tokens = c;
            }
            match polled {
                Poll::Ready(Some(ev)) => {
                    this.next_poll = slot + 1;
                    return Poll::Ready(Some(this.on_event(slot, ev)));
                }
                Poll::Ready(None) => {
                    this.choices[slot].stream = None;
                    let e = EngineError::Internal("generation stream ended without a finish event".into());
                    this.fail(&e.to_string());
                    return Poll::Ready(Some(Err(e.into())));
                }
                Poll::Pending => {}
            }
        }
        if live { Poll::Pending } else { Poll::Ready(None) }
    }
}
