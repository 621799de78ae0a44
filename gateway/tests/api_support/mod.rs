//! Test harness for the HTTP layer: the real router and text pipeline (fixture GGUF) in front
//! of a scripted fake engine.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use futures_util::future::BoxFuture;
use http_body_util::BodyExt;
use minimax_gateway::api::{ApiArgs, AppState, Backend, EngineStats, EventStream, ModelMeta, router};
use minimax_gateway::engine::{
    EngineError, FinishReason, GenEvent, GenerationRequest, RankHealth, ScoreResult, Timings, TokenLogprob, Usage,
};
use minimax_gateway::text::prompt::{PipelineConfig, TextPipeline};
use minimax_gateway::text::tokenizer::Tokenizer;
use minimax_shared::gguf::GgufModel;
use serde_json::Value as Json;
use tower::ServiceExt;

pub const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/m2-small/q8_0.gguf");

/// What the fake engine generates for one request.
#[derive(Clone, Debug)]
pub struct Script {
    pub tokens: Vec<u32>,
    /// Reason reported when the script runs out (`max_tokens` gives `Length` first).
    pub finish: FinishReason,
    pub delay: Duration,
    pub fail: Option<EngineError>,
    pub cached: u32,
}

pub type ScriptFn = dyn Fn(&str, &GenerationRequest) -> Script + Send + Sync;

pub struct Fake {
    pub tok: Arc<Tokenizer>,
    pub script: Box<ScriptFn>,
    pub refuse: Mutex<Option<EngineError>>,
    pub live: Arc<AtomicUsize>,
    pub cancelled: Arc<AtomicUsize>,
    pub seen: Mutex<Vec<GenerationRequest>>,
    pub health: Mutex<Vec<RankHealth>>,
}

struct Guard {
    live: Arc<AtomicUsize>,
    cancelled: Arc<AtomicUsize>,
    finished: bool,
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
        if !self.finished {
            self.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl Backend for Fake {
    fn generate(&self, req: GenerationRequest) -> Result<EventStream, EngineError> {
        if let Some(e) = self.refuse.lock().unwrap().clone() {
            return Err(e);
        }
        self.seen.lock().unwrap().push(req.clone());
        let text = self.tok.decode(&req.prompt);
        let s = (self.script)(&text, &req);
        self.live.fetch_add(1, Ordering::SeqCst);
        let guard = Guard { live: self.live.clone(), cancelled: self.cancelled.clone(), finished: false };
        let max = req.max_tokens as usize;
        let (tokens, reason) =
            if s.tokens.len() > max { (s.tokens[..max].to_vec(), FinishReason::Length) } else { (s.tokens.clone(), s.finish) };
        let prompt_tokens = req.prompt.len() as u32;
        let lp = req.sampling.logprobs;
        let top = req.sampling.top_logprobs as usize;
        let events: Vec<GenEvent> = std::iter::once(GenEvent::Started { cached_tokens: s.cached })
            .chain(tokens.iter().map(|&id| GenEvent::Token {
                id,
                logprob: lp.then(|| TokenLogprob {
                    logprob: -0.5,
                    top: (0..top as u32).map(|k| (id.wrapping_add(k) % 1000, -0.5 - k as f32)).collect(),
                }),
            }))
            .chain(std::iter::once(match s.fail.clone() {
                Some(e) => GenEvent::Failed(e),
                None => GenEvent::Finished {
                    reason,
                    usage: Usage { prompt_tokens, cached_tokens: s.cached, completion_tokens: tokens.len() as u32 },
                    timings: Timings { queue_ms: 0.1, prefill_ms: 1.0, ttft_ms: 1.0, decode_ms: 2.0 },
                },
            }))
            .collect();
        let delay = s.delay;
        let st = (events.into_iter(), guard);
        Ok(Box::pin(futures_util::stream::unfold(st, move |(mut it, mut g)| async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let ev = it.next()?;
            if matches!(ev, GenEvent::Finished { .. } | GenEvent::Failed(_)) {
                g.finished = true;
            }
            Some((ev, (it, g)))
        })))
    }

    fn score(&self, _id: String, tokens: Vec<u32>) -> BoxFuture<'static, Result<ScoreResult, EngineError>> {
        let n = tokens.len();
        Box::pin(async move { Ok(ScoreResult { logprobs: (1..n).map(|i| -(i as f32) / 10.0).collect(), cached_tokens: 0 }) })
    }

    fn health(&self) -> Vec<RankHealth> {
        self.health.lock().unwrap().clone()
    }

    fn stats(&self) -> EngineStats {
        EngineStats { queue_depth: 0, running_sequences: self.live.load(Ordering::SeqCst) as u64, kv_pages_free: 100, ..Default::default() }
    }
}

pub fn ready(n: u32) -> Vec<RankHealth> {
    (0..n).map(|rank| RankHealth { rank, state: "ready".into(), progress: 1.0, detail: String::new() }).collect()
}

pub struct Harness {
    pub fake: Arc<Fake>,
    pub state: AppState,
    pub tok: Arc<Tokenizer>,
}

pub fn pipeline() -> TextPipeline {
    let m = GgufModel::open(FIXTURE).expect("fixture");
    TextPipeline::from_gguf_metadata(m.metadata(), PipelineConfig::default()).expect("pipeline")
}

/// Encodes text into tokens one character at a time (so tags and stop strings are split).
pub fn char_tokens(tok: &Tokenizer, text: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for ch in text.chars() {
        out.extend(tok.encode_plain(&ch.to_string()).unwrap());
    }
    out
}

impl Harness {
    pub fn new(args: ApiArgs, script: impl Fn(&str, &GenerationRequest) -> Script + Send + Sync + 'static) -> Harness {
        let text = Arc::new(pipeline());
        let tok = text.tokenizer().clone();
        let fake = Arc::new(Fake {
            tok: tok.clone(),
            script: Box::new(script),
            refuse: Mutex::new(None),
            live: Arc::new(AtomicUsize::new(0)),
            cancelled: Arc::new(AtomicUsize::new(0)),
            seen: Mutex::new(Vec::new()),
            health: Mutex::new(ready(2)),
        });
        let model = ModelMeta { id: "m2-small".into(), context_length: 4096, owned_by: "minimax-serve".into(), created: 1 };
        let state = AppState::new(fake.clone(), text, model, args);
        Harness { fake, state, tok }
    }

    /// A fake that answers `text`, one character per token.
    pub fn saying(text: &str) -> Harness {
        Harness::saying_with(ApiArgs::default(), text)
    }

    pub fn saying_with(args: ApiArgs, text: &str) -> Harness {
        let toks = char_tokens(pipeline().tokenizer(), text);
        Harness::new(args, move |_, _| script(toks.clone()))
    }

    pub async fn raw(&self, req: Request<Body>) -> (StatusCode, axum::http::HeaderMap, String) {
        let resp = router(self.state.clone()).oneshot(req).await.unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, headers, String::from_utf8(body.to_vec()).unwrap())
    }

    pub async fn post(&self, path: &str, body: &str) -> (StatusCode, String) {
        let req = Request::post(path).header("content-type", "application/json").body(Body::from(body.to_string())).unwrap();
        let (s, _, b) = self.raw(req).await;
        (s, b)
    }

    pub async fn post_json(&self, path: &str, body: Json) -> (StatusCode, Json) {
        let (s, b) = self.post(path, &body.to_string()).await;
        let v = serde_json::from_str(&b).unwrap_or_else(|e| panic!("not JSON ({e}): {b}"));
        (s, v)
    }

    pub async fn get(&self, path: &str) -> (StatusCode, String) {
        let (s, _, b) = self.raw(Request::get(path).body(Body::empty()).unwrap()).await;
        (s, b)
    }
}

pub fn script(tokens: Vec<u32>) -> Script {
    Script { tokens, finish: FinishReason::Stop, delay: Duration::ZERO, fail: None, cached: 0 }
}

/// Parses an SSE body into its `data:` payloads; checks the framing on the way.
pub fn sse_events(body: &str) -> Vec<String> {
    assert!(body.ends_with("\n\n"), "SSE body must end with a blank line: {body:?}");
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            assert!(e.starts_with("data: "), "event is not `data: ...`: {e:?}");
            assert!(!e[6..].contains('\n'), "event spans lines: {e:?}");
            e[6..].to_string()
        })
        .collect()
}
