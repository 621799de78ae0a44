//! Malformed-input sweep of every request reader: each field of a few valid
//! requests replaced by odd values, removed, or repeated to large sizes; the readers and the
//! whole router (real text pipeline from the fixture GGUF, a fake engine that answers at once)
//! must answer 4xx, never panic, never 5xx, and not take long.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use futures_util::future::BoxFuture;
use http_body_util::BodyExt;
use serde_json::{Map, Value as Json, json};
use tower::ServiceExt;

use super::params::{Endpoint, Fields, common, prompts};
use super::{ApiArgs, AppState, Backend, EngineStats, EventStream, ModelMeta, router};
use crate::engine::{EngineError, FinishReason, GenEvent, GenerationRequest, RankHealth, SamplingParams, ScoreResult, Timings, Usage};
use crate::text::prompt::{PipelineConfig, TextPipeline};
use crate::text::request::ChatText;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/m2-small/q8_0.gguf");

struct Instant0;

impl Backend for Instant0 {
    fn generate(&self, req: GenerationRequest) -> Result<EventStream, EngineError> {
        let usage = Usage { prompt_tokens: req.prompt.len() as u32, cached_tokens: 0, completion_tokens: 0 };
        let ev = vec![
            GenEvent::Started { cached_tokens: 0 },
            GenEvent::Finished { reason: FinishReason::Stop, usage, timings: Timings::default() },
        ];
        Ok(Box::pin(futures_util::stream::iter(ev)))
    }
    fn score(&self, _id: String, tokens: Vec<u32>) -> BoxFuture<'static, Result<ScoreResult, EngineError>> {
        let n = tokens.len();
        Box::pin(async move { Ok(ScoreResult { logprobs: vec![-0.1; n.saturating_sub(1)], cached_tokens: 0 }) })
    }
    fn health(&self) -> Vec<RankHealth> {
        vec![RankHealth { rank: 0, state: "ready".into(), progress: 1.0, detail: String::new() }]
    }
    fn stats(&self) -> EngineStats {
        EngineStats::default()
    }
}

fn state() -> AppState {
    static ST: OnceLock<AppState> = OnceLock::new();
    ST.get_or_init(|| {
        let m = minimax_shared::gguf::GgufModel::open(FIXTURE).expect("fixture");
        let text = TextPipeline::from_gguf_metadata(m.metadata(), PipelineConfig::default()).expect("pipeline");
        let model = ModelMeta { id: "m2-small".into(), context_length: 4096, owned_by: "t".into(), created: 1 };
        AppState::new(Arc::new(Instant0), Arc::new(text), model, ApiArgs::default())
    })
    .clone()
}

/// One request through the whole router: (status, body, time) or the panic message.
fn post(path: &str, body: String) -> Result<(StatusCode, String, Duration), String> {
    let st = state();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let t = Instant::now();
    let r = catch_unwind(AssertUnwindSafe(|| {
        rt.block_on(async {
            let req = Request::post(path).header("content-type", "application/json").body(Body::from(body)).unwrap();
            let resp = router(st).oneshot(req).await.unwrap();
            let status = resp.status();
            let b = resp.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8_lossy(&b).into_owned())
        })
    }));
    let dt = t.elapsed();
    r.map(|(s, b)| (s, b, dt)).map_err(panic_text)
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_else(|| "<panic>".into())
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Chat,
    Completions,
    Responses,
    Messages,
    CountTokens,
}

impl Kind {
    fn path(self) -> &'static str {
        match self {
            Kind::Chat => "/v1/chat/completions",
            Kind::Completions => "/v1/completions",
            Kind::Responses => "/v1/responses",
            Kind::Messages => "/v1/messages",
            Kind::CountTokens => "/v1/messages/count_tokens",
        }
    }
}

/// The readers alone, on a `Value` (may be deeper than JSON text allows): validation result
/// as `Ok(())` / `Err(param)`.
fn read_direct(kind: Kind, v: &Json) -> Result<(), Option<String>> {
    let Some(obj) = v.as_object() else { return Err(None) };
    let d = SamplingParams::default();
    let e = |e: super::ApiError| e.param;
    let chat: ChatText = match kind {
        Kind::Chat | Kind::Completions => {
            let mut f = Fields::new(obj);
            let ep = if matches!(kind, Kind::Chat) { Endpoint::Chat } else { Endpoint::Completions };
            common(&mut f, ep, &d, 16, 200_000).map_err(e)?;
            super::format::chat_response_format(f.get("response_format")).map_err(e)?;
            if matches!(kind, Kind::Completions) {
                prompts(f.get("prompt"), "prompt", 200_000).map_err(e)?;
                return Ok(());
            }
            let messages = match f.get("messages") {
                Some(Json::Array(a)) => a.clone(),
                _ => return Err(Some("messages".into())),
            };
            ChatText {
                messages,
                tools: f.get("tools").cloned(),
                tool_choice: f.get("tool_choice").cloned(),
                parallel_tool_calls: f.bool("parallel_tool_calls").map_err(e)?,
                chat_template_kwargs: f.get("chat_template_kwargs").cloned(),
                reasoning_format: f.string("reasoning_format").map_err(e)?.map(str::to_string),
            }
        }
        Kind::Responses => super::responses::request::read(obj, &d).map_err(e)?.0,
        Kind::Messages => super::messages::request::read(obj, &d, false).map_err(e)?.0,
        Kind::CountTokens => super::messages::request::read(obj, &d, true).map_err(e)?.0,
    };
    chat.validate().map(|_| ()).map_err(|x| Some(x.param))
}

fn seeds() -> Vec<(Kind, Json)> {
    let tool = json!({"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}});
    vec![
        (Kind::Chat, json!({
            "model": "m2-small", "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.1, "n": 1, "seed": 7, "max_tokens": 16,
            "max_completion_tokens": 16, "stop": ["END", "STOP"], "presence_penalty": 0.1, "frequency_penalty": 0.1,
            "repetition_penalty": 1.1, "logit_bias": {"5": 1.5}, "logprobs": true, "top_logprobs": 2, "stream": false,
            "parallel_tool_calls": true, "reasoning_format": "parsed", "chat_template_kwargs": {"x": 1}, "user": "u",
            "tools": [tool], "tool_choice": "auto",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {"role": "assistant", "content": null, "reasoning_content": "think",
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "user", "content": "thanks", "name": "bob"},
            ]
        })),
        (Kind::Chat, json!({"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})),
        (Kind::Chat, json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "stream_options": {"include_usage": true},
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "strict": true,
                "schema": {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}, "b": {"type": "array", "items": {"type": "integer"}}}, "required": ["a"]}}}})),
        (Kind::Completions, json!({"model": "m2-small", "prompt": "Hello", "max_tokens": 8, "n": 2, "best_of": 2, "logprobs": 2, "echo": false,
            "suffix": "", "stop": "x", "temperature": 0.5, "seed": 1, "logit_bias": {"1": -1}})),
        (Kind::Completions, json!({"prompt": [[1, 2, 3], "text"], "max_tokens": 4, "response_format": {"type": "json_object"}})),
        (Kind::Responses, json!({
            "model": "m", "instructions": "You are a coding agent.", "max_output_tokens": 100, "stream": false, "store": false,
            "temperature": 0.5, "top_p": 0.9, "seed": 3, "reasoning": {"effort": "high", "summary": "auto"}, "metadata": {"a": "b"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}},
            "tools": [{"type": "function", "name": "shell", "description": "Run", "parameters": {"type": "object", "properties": {"command": {"type": "array"}}}},
                      {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}},
                      {"type": "namespace", "name": "mcp", "tools": [{"type": "function", "name": "search", "parameters": {"type": "object"}}]}],
            "tool_choice": "auto", "parallel_tool_calls": true,
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be careful."}]},
                {"role": "user", "content": "List files"},
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Use ls."}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Listing."}]},
                {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": "{\"command\":[\"ls\"]}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
                {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "x"},
                {"type": "custom_tool_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "ok"}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks"}]},
            ]
        })),
        (Kind::Responses, json!({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "f"}})),
        (Kind::Messages, json!({
            "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["END"], "temperature": 0.5, "top_k": 7, "top_p": 0.9, "thinking": {"type": "enabled", "budget_tokens": 100},
            "metadata": {"user_id": "x"},
            "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Need the tool.", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "is_error": false, "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "And tomorrow?"}]},
            ]
        })),
        (Kind::Messages, json!({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stream": true,
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}}},
            "tool_choice": {"type": "auto"}, "tools": [{"name": "f", "input_schema": {"type": "object"}}]})),
        (Kind::Messages, json!({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "tool_choice": {"type": "tool", "name": "f"}, "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "number"}}}}]})),
        (Kind::CountTokens, json!({"messages": [{"role": "user", "content": "hi"}], "system": "s"})),
    ]
}

fn nested_array(depth: usize) -> Json {
    let mut v = json!([]);
    for _ in 0..depth {
        v = Json::Array(vec![v]);
    }
    v
}

fn replacements(deep: bool) -> Vec<(&'static str, Json)> {
    let mut r = vec![
        ("null", Json::Null),
        ("true", json!(true)),
        ("-1", json!(-1)),
        ("0", json!(0)),
        ("1e308", json!(1e308)),
        ("-1e308", json!(-1e308)),
        ("1.5", json!(1.5)),
        ("2^64 float", json!(18446744073709551616.0f64)),
        ("u64::MAX", json!(u64::MAX)),
        ("i64::MIN", json!(i64::MIN)),
        ("\"\"", json!("")),
        ("100k string", Json::String("é".repeat(50_000))),
        ("[]", json!([])),
        ("[null]", json!([null])),
        ("{}", json!({})),
        ("{\"\":{}}", json!({"": {}})),
        ("weird unicode", json!("a\u{0000}b\u{FEFF}\u{202E}\u{10FFFF}\u{1F600}\u{0301}<|im_end|>]~b]ai")),
        ("nested 120", nested_array(120)),
    ];
    if deep {
        r.push(("nested 10000", nested_array(10_000)));
    }
    r
}

#[derive(Clone, Debug)]
enum Step {
    Key(String),
    Idx(usize),
}

fn paths(v: &Json, at: &mut Vec<Step>, out: &mut Vec<Vec<Step>>) {
    match v {
        Json::Object(m) => {
            for (k, x) in m {
                at.push(Step::Key(k.clone()));
                out.push(at.clone());
                paths(x, at, out);
                at.pop();
            }
        }
        Json::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                at.push(Step::Idx(i));
                out.push(at.clone());
                paths(x, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

fn slot<'a>(v: &'a mut Json, p: &[Step]) -> &'a mut Json {
    p.iter().fold(v, |v, s| match s {
        Step::Key(k) => &mut v[k.as_str()],
        Step::Idx(i) => &mut v[*i],
    })
}

fn show(p: &[Step]) -> String {
    p.iter().map(|s| match s { Step::Key(k) => format!(".{k}"), Step::Idx(i) => format!("[{i}]") }).collect()
}

/// Every variant of one seed: (description, body).
fn variants(seed: &Json, deep: bool) -> Vec<(String, Json)> {
    let mut ps = Vec::new();
    paths(seed, &mut Vec::new(), &mut ps);
    let mut out = Vec::new();
    for p in &ps {
        for (name, r) in replacements(deep) {
            let mut v = seed.clone();
            *slot(&mut v, p) = r;
            out.push((format!("{} = {name}", show(p)), v));
        }
        // Remove the field / element.
        let mut v = seed.clone();
        let (last, parent) = p.split_last().unwrap();
        match (slot(&mut v, parent), last) {
            (Json::Object(m), Step::Key(k)) => {
                m.remove(k);
            }
            (Json::Array(a), Step::Idx(i)) => {
                a.remove(*i);
            }
            _ => unreachable!(),
        }
        out.push((format!("{} removed", show(p)), v));
        // Arrays grown to 10k by repeating their first element.
        if let Json::Array(a) = &seed_at(seed, p)
            && !a.is_empty()
        {
            let mut v = seed.clone();
            let grown: Vec<Json> = a.iter().cycle().take(10_000).cloned().collect();
            *slot(&mut v, p) = Json::Array(grown);
            out.push((format!("{} x10000", show(p)), v));
        }
    }
    out
}

fn seed_at(seed: &Json, p: &[Step]) -> Json {
    let mut v = seed.clone();
    slot(&mut v, p).clone()
}

#[derive(Default)]
struct Findings {
    lines: Vec<String>,
    requests: usize,
}

impl Findings {
    fn check_http(&mut self, kind: Kind, what: &str, body: &Json) {
        self.requests += 1;
        let text = body.to_string();
        match post(kind.path(), text) {
            Err(p) => self.lines.push(format!("PANIC {kind:?} {what}: {p}")),
            Ok((s, b, dt)) => {
                // 502 tool_choice_unmet: the fake engine says nothing, so a demanded call is unmet.
                if s.is_server_error() && !(s == StatusCode::BAD_GATEWAY && b.contains("tool_choice")) {
                    self.lines.push(format!("{s} {kind:?} {what}: {}", b.chars().take(300).collect::<String>()));
                }
                if dt > Duration::from_millis(1000) {
                    self.lines.push(format!("SLOW {:.2}s {s} {kind:?} {what}", dt.as_secs_f64()));
                }
                if s == StatusCode::BAD_REQUEST {
                    let v: Json = serde_json::from_str(&b).unwrap_or(Json::Null);
                    let msg = v["error"]["message"].as_str().unwrap_or("");
                    // Anthropic bodies have no `param`: the message starts with the field.
                    let named = msg.split_once(": ").is_some_and(|(f, _)| !f.is_empty() && !f.contains(' '));
                    let has_param = !v["error"]["param"].is_null() || msg.starts_with("the request body") || (v["type"] == "error" && named);
                    if !has_param {
                        self.lines.push(format!("NO-PARAM {kind:?} {what}: {}", b.chars().take(200).collect::<String>()));
                    }
                }
            }
        }
    }

    fn check_direct(&mut self, kind: Kind, what: &str, body: &Json) {
        let t = Instant::now();
        let r = catch_unwind(AssertUnwindSafe(|| read_direct(kind, body)));
        let dt = t.elapsed();
        if let Err(p) = r {
            self.lines.push(format!("PANIC(direct) {kind:?} {what}: {}", panic_text(p)));
        }
        if dt > Duration::from_millis(1000) {
            self.lines.push(format!("SLOW(direct) {:.2}s {kind:?} {what}", dt.as_secs_f64()));
        }
    }
}

fn run_big_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new().stack_size(512 << 20).spawn(f).unwrap().join().unwrap()
}

/// The sweep: prints every finding; fails when there is one.
#[test]
#[ignore = "long sweep; run with --ignored sweep"]
fn sweep() {
    let lines = run_big_stack(|| {
        let mut f = Findings::default();
        for (kind, seed) in seeds() {
            // The seed itself must be accepted.
            let (s, b, _) = post(kind.path(), seed.to_string()).unwrap();
            assert!(s.is_success() || (s == StatusCode::BAD_GATEWAY && b.contains("tool_choice")), "{kind:?} seed refused: {b}");
            for (what, v) in variants(&seed, true) {
                f.check_direct(kind, &what, &v);
                if !what.contains("nested 10000") {
                    f.check_http(kind, &what, &v);
                }
            }
            eprintln!("{kind:?}: {} requests so far, {} findings", f.requests, f.lines.len());
        }
        f.lines
    });
    for l in &lines {
        eprintln!("FINDING {l}");
    }
    assert!(lines.is_empty(), "{} findings", lines.len());
}

/// Large collections and numeric edge cases, one by one, timed.
#[test]
#[ignore = "long sweep; run with --ignored large"]
fn large() {
    let mut f = Findings::default();
    let user = json!({"role": "user", "content": "hi"});
    let tools: Vec<Json> = (0..10_000)
        .map(|i| json!({"type": "function", "function": {"name": format!("f{i}"), "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}))
        .collect();
    let bias: Map<String, Json> = (0..100_000).map(|i| (i.to_string(), json!(1))).collect();
    let cases: Vec<(Kind, &str, Json)> = vec![
        (Kind::Chat, "10k messages", json!({"messages": vec![user.clone(); 10_000], "max_tokens": 1})),
        (Kind::Chat, "10k tools", json!({"messages": [user], "tools": tools})),
        (Kind::Chat, "10k tools, required", json!({"messages": [user], "tools": tools, "tool_choice": "required"})),
        (Kind::Chat, "10k stop", json!({"messages": [user], "stop": vec!["x"; 10_000]})),
        (Kind::Chat, "logit_bias 100k", json!({"messages": [user], "logit_bias": bias})),
        (Kind::Chat, "stop empty string", json!({"messages": [user], "stop": [""]})),
        (Kind::Chat, "stop empty string alone", json!({"messages": [user], "stop": ""})),
        (Kind::Chat, "logit_bias key -1", json!({"messages": [user], "logit_bias": {"-1": 1}})),
        (Kind::Chat, "logit_bias key +5", json!({"messages": [user], "logit_bias": {"+5": 1}})),
        (Kind::Chat, "logit_bias key 1e3", json!({"messages": [user], "logit_bias": {"1e3": 1}})),
        (Kind::Chat, "logit_bias key 2^32", json!({"messages": [user], "logit_bias": {"4294967296": 1}})),
        (Kind::Chat, "seed u64::MAX", json!({"messages": [user], "seed": u64::MAX})),
        (Kind::Chat, "seed 2^64 float", json!({"messages": [user], "seed": 18446744073709551616.0f64})),
        (Kind::Chat, "max_tokens 2^32", json!({"messages": [user], "max_tokens": 4294967296u64})),
        (Kind::Chat, "max_tokens u32::MAX", json!({"messages": [user], "max_tokens": u32::MAX})),
        (Kind::Chat, "n 16 seed u64::MAX", json!({"messages": [user], "n": 16, "seed": -1})),
        (Kind::Chat, "top_k u32::MAX", json!({"messages": [user], "top_k": u32::MAX})),
        (Kind::Chat, "top_k 1e300", json!({"messages": [user], "top_k": 1e300})),
        (Kind::Chat, "temperature 1e-320", json!({"messages": [user], "temperature": 1e-320})),
        (Kind::Chat, "repetition_penalty 1e308", json!({"messages": [user], "repetition_penalty": 1e308})),
        (Kind::Chat, "repetition_penalty 1e-320", json!({"messages": [user], "repetition_penalty": 1e-320})),
        (Kind::Completions, "prompt 100k token ids", json!({"prompt": vec![5; 100_000]})),
        (Kind::Completions, "prompt 10k strings", json!({"prompt": vec!["a"; 10_000], "max_tokens": 1})),
        (Kind::Completions, "prompt [[]]", json!({"prompt": [[]]})),
        (Kind::Completions, "prompt [\"\"]", json!({"prompt": [""]})),
        (Kind::Completions, "prompt token u32::MAX+1", json!({"prompt": [4294967296u64]})),
        (Kind::Completions, "n 16 x 1k prompts", json!({"prompt": vec!["a"; 1000], "n": 16, "best_of": 16, "max_tokens": 1})),
        (Kind::Messages, "10k stop_sequences", json!({"max_tokens": 1, "messages": [user], "stop_sequences": vec!["x"; 10_000]})),
        (Kind::Messages, "10k turns alternating", json!({"max_tokens": 1, "messages": (0..10_001).map(|i| if i % 2 == 0 { json!({"role": "user", "content": "a"}) } else { json!({"role": "assistant", "content": "b"}) }).collect::<Vec<_>>()})),
        (Kind::Messages, "10k assistant turns merged", json!({"max_tokens": 1, "messages": std::iter::once(json!({"role": "user", "content": "a"})).chain((0..10_000).map(|i| json!({"role": "assistant", "content": [{"type": "tool_use", "id": format!("t{i}"), "name": "f", "input": {}}]}))).chain(std::iter::once(json!({"role": "user", "content": "z"}))).collect::<Vec<_>>()})),
        (Kind::Responses, "10k input items", json!({"input": vec![json!({"role": "user", "content": "a"}); 10_000]})),
        (Kind::Responses, "10k developer items", json!({"input": vec![json!({"role": "developer", "content": "a"}); 10_000].into_iter().chain(std::iter::once(json!({"role": "user", "content": "u"}))).collect::<Vec<_>>()})),
        (Kind::Responses, "10k function calls", json!({"input": std::iter::once(json!({"role": "user", "content": "a"})).chain((0..10_000).map(|i| json!({"type": "function_call", "call_id": format!("c{i}"), "name": "f", "arguments": "{}"}))).chain(std::iter::once(json!({"type": "function_call_output", "call_id": "c0", "output": "x"}))).collect::<Vec<_>>()})),
    ];
    for (kind, what, v) in cases {
        let t = Instant::now();
        f.check_direct(kind, what, &v);
        f.check_http(kind, what, &v);
        eprintln!("{kind:?} {what}: {:.3}s", t.elapsed().as_secs_f64());
    }
    for l in &f.lines {
        eprintln!("FINDING {l}");
    }
    assert!(f.lines.is_empty(), "{} findings", f.lines.len());
}

/// A tool whose parameter is a single-schema `allOf` that refers back to itself: reading the
/// tools must answer (accept, or refuse with a 400), not recurse until the stack overflows.
#[test]
fn tool_param_allof_self_ref_does_not_recurse_forever() {
    let params = json!({"type": "object", "properties": {"x": {"allOf": [{"$ref": "#/properties/x"}]}}});
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": params}}]);
    // The server's worker threads have 2 MiB stacks (tokio's default); so does this one.
    let r = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || crate::text::request::parse_tools(Some(&tools)).map(|t| t.len()))
        .unwrap()
        .join();
    assert!(r.is_ok(), "parse_tools panicked");
}

/// The same through the HTTP layer (chat completions).
#[test]
fn http_tool_param_allof_self_ref() {
    let body = json!({"messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"allOf": [{"$ref": "#/properties/x"}]}}}}}]});
    let r = std::thread::Builder::new().stack_size(2 << 20).spawn(move || post("/v1/chat/completions", body.to_string()).map(|(s, b, _)| (s, b))).unwrap().join().unwrap();
    let (s, b) = r.expect("no panic");
    assert!(s.is_client_error() || s.is_success(), "{s} {b}");
}

/// A parameter whose `anyOf` refers back to itself, with a tool choice that demands a call (so
/// the tool-call grammar is compiled, as by default): no endless recursion.
#[test]
fn http_tool_param_anyof_self_ref_required() {
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"anyOf": [{"$ref": "#/properties/x"}]}}}}}]});
    let r = std::thread::Builder::new().stack_size(2 << 20).spawn(move || post("/v1/chat/completions", body.to_string()).map(|(s, b, _)| (s, b))).unwrap().join().unwrap();
    let (s, b) = r.expect("no panic");
    // The fake engine writes nothing, so the demanded call is unmet (502): the request ran.
    assert!(s.is_client_error() || s.is_success() || b.contains("tool_choice_unmet"), "{s} {b}");
}

/// Many parameters that each `$ref` one large definition: each is resolved into its own copy.
#[test]
#[ignore = "measurement; run with --ignored ref_amplification"]
fn ref_amplification() {
    for (props, big_keys) in [(1_000usize, 1_000usize), (4_000, 1_000), (4_000, 4_000)] {
        let big: Map<String, Json> = (0..big_keys).map(|i| (format!("k{i}"), json!({"type": "string", "description": "0123456789"}))).collect();
        let properties: Map<String, Json> = (0..props).map(|i| (format!("p{i}"), json!({"$ref": "#/$defs/big"}))).collect();
        let params = json!({"type": "object", "$defs": {"big": {"type": "object", "properties": big}}, "properties": properties});
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": params}}]);
        let body_len = tools.to_string().len();
        let t = Instant::now();
        let r = crate::text::request::parse_tools(Some(&tools));
        let dt = t.elapsed();
        let kept: usize = r.as_ref().map(|ts| ts.iter().map(|t| (0..props).filter_map(|i| t.param_schema(&format!("p{i}"))).map(|s| s.to_string().len()).sum::<usize>()).sum()).unwrap_or(0);
        eprintln!("props {props} x def {big_keys} keys: body {body_len} B, parse_tools {:.2}s, ok={}, resolved params {} B ({}x the body)", dt.as_secs_f64(), r.is_ok(), kept, kept / body_len.max(1));
    }
}

/// Which step overflows on the `anyOf` self-reference: reading the tools, validating
/// arguments against the schema, or the tool-call grammar.
#[test]
fn anyof_self_ref_parse_tools() {
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"anyOf": [{"$ref": "#/properties/x"}]}}}}}]);
    let r = std::thread::Builder::new().stack_size(2 << 20).spawn(move || crate::text::request::parse_tools(Some(&tools)).is_ok()).unwrap().join();
    eprintln!("parse_tools: {r:?}");
}

#[test]
fn anyof_self_ref_http_auto() {
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"anyOf": [{"$ref": "#/properties/x"}]}}}}}]});
    let r = std::thread::Builder::new().stack_size(2 << 20).spawn(move || post("/v1/chat/completions", body.to_string()).map(|(s, _, _)| s)).unwrap().join();
    eprintln!("auto: {r:?}");
}

#[test]
fn anyof_self_ref_validate_args() {
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"anyOf": [{"$ref": "#/properties/x"}]}}}}}]);
    let r = std::thread::Builder::new().stack_size(2 << 20).spawn(move || {
        let ts = crate::text::request::parse_tools(Some(&tools)).unwrap();
        ts.get("f").unwrap().validate(&json!({"x": 1})).is_ok()
    }).unwrap().join();
    eprintln!("validate: {r:?}");
}

#[test]
fn anyof_self_ref_param_form() {
    let root = json!({"type": "object", "properties": {"x": {"anyOf": [{"$ref": "#/properties/x"}]}}});
    let r = std::thread::Builder::new().stack_size(2 << 20).spawn(move || {
        let x = crate::text::toolcall::param_schema::resolve(&root["properties"]["x"], &root);
        format!("{:?}", crate::text::toolcall::param_schema::ParamForm::of(&x, &root))
    }).unwrap().join();
    eprintln!("ParamForm::of: {r:?}");
}

/// How request time grows with the number of tools / turns (quadratic growth is a DoS inside
/// the body limit).
#[test]
#[ignore = "measurement; run with --ignored scaling"]
fn scaling() {
    let user = json!({"role": "user", "content": "hi"});
    for n in [5_000usize, 10_000, 20_000, 40_000] {
        let tools: Vec<Json> = (0..n)
            .map(|i| json!({"type": "function", "function": {"name": format!("f{i}"), "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}))
            .collect();
        let tools = Json::Array(tools);
        let body = json!({"messages": [user], "tools": tools}).to_string();
        let t = Instant::now();
        let r = crate::text::request::parse_tools(Some(&tools)).map(|t| t.len());
        let d1 = t.elapsed();
        let t = Instant::now();
        let (s, _, _) = post("/v1/chat/completions", body.clone()).unwrap();
        let d2 = t.elapsed();
        eprintln!("tools {n}: body {} KB, parse_tools {:.2}s ({:?}), http {:.2}s {s}", body.len() / 1024, d1.as_secs_f64(), r.is_ok(), d2.as_secs_f64());
    }
    // The Messages seed's three turns (user, assistant tool_use, user tool_result) repeated.
    let turns = [
        json!({"role": "user", "content": "Weather in Paris?"}),
        json!({"role": "assistant", "content": [{"type": "text", "text": "Checking."}, {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]}),
        json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": [{"type": "text", "text": "sunny"}]}, {"type": "text", "text": "And tomorrow?"}]}),
    ];
    for n in [3_000usize, 6_000, 12_000, 24_000] {
        let msgs: Vec<Json> = turns.iter().cycle().take(n).cloned().collect();
        let body = json!({"max_tokens": 8, "messages": msgs});
        let t = Instant::now();
        let (s, b, _) = post("/v1/messages", body.to_string()).unwrap();
        let d = t.elapsed();
        let t = Instant::now();
        let (chat, _) = super::messages::request::read(body.as_object().unwrap(), &SamplingParams::default(), false).unwrap();
        let d1 = t.elapsed();
        let (d2, ok, d3, p) = validate_and_prepare(&chat);
        eprintln!("messages turns {n}: body {} KB, http {:.2}s {s} {}, read {:.2}s, validate {:.2}s {ok}, prepare {:.2}s {p:?}",
            body.to_string().len() / 1024, d.as_secs_f64(), b.chars().take(120).collect::<String>(), d1.as_secs_f64(), d2.as_secs_f64(), d3.as_secs_f64());
    }
}

/// How long `chat` takes to validate (and whether it passes) and to render into a prompt (its
/// token count, or the error): the measurement tests' two timed steps.
fn validate_and_prepare(chat: &ChatText) -> (Duration, bool, Duration, Result<usize, String>) {
    let t = Instant::now();
    let ok = chat.validate().is_ok();
    let dv = t.elapsed();
    let t = Instant::now();
    let p = state().text.prepare(chat).map(|p| p.prompt_ids.len()).map_err(|e| e.to_string());
    (dv, ok, t.elapsed(), p)
}

/// Parameters that each `$ref` one large definition (334 KB body): refused with a 400 naming
/// the field (before: 24 s and ~840 MB of resolved copies, growing as props x def).
#[test]
fn ref_expansion_is_bounded() {
    let big: Map<String, Json> = (0..4_000).map(|i| (format!("k{i}"), json!({"type": "string", "description": "0123456789"}))).collect();
    let properties: Map<String, Json> = (0..4_000).map(|i| (format!("p{i}"), json!({"$ref": "#/$defs/big"}))).collect();
    let params = json!({"type": "object", "$defs": {"big": {"type": "object", "properties": big}}, "properties": properties});
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": params}}]);
    let e = crate::text::request::parse_tools(Some(&tools)).map(|t| t.len()).unwrap_err();
    assert!(e.param.starts_with("tools[0].function.parameters.properties.p"), "{e}");
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "tools": tools});
    let (s, b, _) = post("/v1/chat/completions", body.to_string()).unwrap();
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    // A few references to a modest definition still read.
    let small = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
        "$defs": {"c": {"enum": ["r", "g"]}}, "properties": {"a": {"$ref": "#/$defs/c"}, "b": {"allOf": [{"$ref": "#/$defs/c"}]}}}}}]);
    let ts = crate::text::request::parse_tools(Some(&small)).unwrap();
    assert_eq!(ts.get("f").unwrap().param_schema("b"), Some(&json!({"enum": ["r", "g"]})));
}

/// Many tool results in one user turn (each a `tool` message answering the same call).
#[test]
#[ignore = "measurement; run with --ignored tool_results_scaling"]
fn tool_results_scaling() {
    for n in [5_000usize, 20_000, 80_000] {
        let results: Vec<Json> = (0..n).map(|_| json!({"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"})).collect();
        let body = json!({"max_tokens": 8, "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": results}]});
        let (chat, _) = super::messages::request::read(body.as_object().unwrap(), &SamplingParams::default(), false).unwrap();
        let (d2, ok, d3, p) = validate_and_prepare(&chat);
        eprintln!("tool results {n}: body {} KB, validate {:.3}s {ok}, prepare {:.3}s {p:?}", body.to_string().len() / 1024, d2.as_secs_f64(), d3.as_secs_f64());
    }
}

/// 80k tool results answering one call (5 MB): validating is linear (before: each scanned back
/// over all the tool messages before it, 3.8 s here and ~40 s at the 16 MB body limit).
#[test]
fn many_tool_results_validate_linearly() {
    let call = json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
    let mut messages = vec![json!({"role": "user", "content": "hi"}), call];
    messages.extend((0..80_000).map(|_| json!({"role": "tool", "tool_call_id": "c1", "content": "x"})));
    let chat = ChatText { messages, ..Default::default() };
    // (Its time is measured by `tool_results_scaling`, not asserted: no timed tests.)
    assert!(chat.validate().is_ok());
}
