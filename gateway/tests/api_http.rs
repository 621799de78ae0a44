//! The HTTP layer end to end through the real router and text pipeline, with a scripted fake
//! engine: response shapes, SSE framing, stream/non-stream equality, stop strings, tools,
//! reasoning, n > 1, batches, logprobs, errors and metrics.

mod api_support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use api_support::*;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use futures_util::StreamExt;

use minimax_gateway::api::{ApiArgs, router};
use minimax_gateway::engine::EngineError;
use serde_json::{Value as Json, json};
use tower::ServiceExt;

fn chat_body(extra: Json) -> Json {
    let mut b = json!({"model": "m2-small", "messages": [{"role": "user", "content": "Hi"}]});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// Rebuilds a non-streamed chat message from SSE chunks.
fn assemble_chat(events: &[String]) -> (Vec<Json>, Option<Json>) {
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "stream must end with [DONE]");
    let mut choices: Vec<Json> = Vec::new();
    let mut usage = None;
    for e in &events[..events.len() - 1] {
        let c: Json = serde_json::from_str(e).unwrap();
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(u) = c.get("usage").filter(|u| !u.is_null()) {
            assert!(c["choices"].as_array().unwrap().is_empty(), "usage chunk has no choices");
            usage = Some(u.clone());
            continue;
        }
        for ch in c["choices"].as_array().unwrap() {
            let i = ch["index"].as_u64().unwrap() as usize;
            while choices.len() <= i {
                choices.push(json!({"message": {"content": "", "reasoning_content": ""}, "tool_calls": [], "finish_reason": null, "chunks": 0}));
            }
            let slot = &mut choices[i];
            assert!(slot["finish_reason"].is_null(), "chunk after finish_reason");
            let d = &ch["delta"];
            if slot["chunks"] == 0 {
                assert_eq!(d["role"], "assistant", "first chunk of a choice carries the role");
            }
            slot["chunks"] = json!(slot["chunks"].as_u64().unwrap() + 1);
            if let Some(t) = d["content"].as_str() {
                let s = slot["message"]["content"].as_str().unwrap().to_string() + t;
                slot["message"]["content"] = json!(s);
            }
            if let Some(t) = d["reasoning_content"].as_str() {
                let s = slot["message"]["reasoning_content"].as_str().unwrap().to_string() + t;
                slot["message"]["reasoning_content"] = json!(s);
            }
            if let Some(calls) = d["tool_calls"].as_array() {
                for tc in calls {
                    let k = tc["index"].as_u64().unwrap() as usize;
                    let list = slot["tool_calls"].as_array_mut().unwrap();
                    if k == list.len() {
                        assert!(tc["id"].is_string() && tc["function"]["name"].is_string(), "first delta of a call names it");
                        list.push(json!({"id": tc["id"], "type": "function", "function": {"name": tc["function"]["name"], "arguments": ""}}));
                    }
                    let a = list[k]["function"]["arguments"].as_str().unwrap().to_string()
                        + tc["function"]["arguments"].as_str().unwrap_or("");
                    list[k]["function"]["arguments"] = json!(a);
                }
            }
            if !ch["finish_reason"].is_null() {
                slot["finish_reason"] = ch["finish_reason"].clone();
            }
        }
    }
    (choices, usage)
}

#[tokio::test]
async fn chat_splits_reasoning_and_reports_usage() {
    let h = Harness::saying("Let me think.\n</think>\n\nHello there!");
    let (s, v) = h.post_json("/v1/chat/completions", chat_body(json!({}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["model"], "m2-small");
    let c = &v["choices"][0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["message"]["role"], "assistant");
    assert_eq!(c["message"]["reasoning_content"], "Let me think.");
    assert_eq!(c["message"]["content"], "Hello there!");
    assert_eq!(c["finish_reason"], "stop");
    assert!(c["logprobs"].is_null());
    let u = &v["usage"];
    let prompt = h.fake.seen.lock().unwrap()[0].prompt.len() as u64;
    assert_eq!(u["prompt_tokens"], prompt);
    assert_eq!(u["completion_tokens"].as_u64().unwrap(), char_tokens(&h.tok, "Let me think.\n</think>\n\nHello there!").len() as u64);
    assert_eq!(u["total_tokens"].as_u64().unwrap(), prompt + u["completion_tokens"].as_u64().unwrap());
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0);
    // Engine request: end-of-generation ids, the rest of the context, defaults.
    let req = h.fake.seen.lock().unwrap()[0].clone();
    assert_eq!(req.stop_token_ids, h.tok.eog_ids());
    assert_eq!(req.max_tokens as usize, 4096 - req.prompt.len());
    assert_eq!(req.sampling.top_k, 40);
    // The raw format keeps everything in content.
    let (_, v) = h.post_json("/v1/chat/completions", chat_body(json!({"reasoning_format": "none"}))).await;
    assert_eq!(v["choices"][0]["message"]["content"], "Let me think.\n</think>\n\nHello there!");
    assert!(v["choices"][0]["message"].get("reasoning_content").is_none());
}

#[tokio::test]
async fn chat_stream_framing_and_equality_with_non_stream() {
    let h = Harness::saying("Reason.</think>\n\nAnswer with ünïcödé 🎉 text.");
    let (s, plain) = h.post_json("/v1/chat/completions", chat_body(json!({"seed": 7}))).await;
    assert_eq!(s, StatusCode::OK);
    let req = Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Body::from(chat_body(json!({"seed": 7, "stream": true, "stream_options": {"include_usage": true}})).to_string()))
        .unwrap();
    let (s, headers, body) = h.raw(req).await;
    assert_eq!(s, StatusCode::OK);
    assert!(headers["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let events = sse_events(&body);
    let first: Json = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
    assert!(first.get("usage").unwrap().is_null(), "with include_usage every chunk has usage: null");
    let (choices, usage) = assemble_chat(&events);
    assert_eq!(choices.len(), 1);
    let m = &plain["choices"][0]["message"];
    assert_eq!(choices[0]["message"]["content"], m["content"]);
    assert_eq!(choices[0]["message"]["reasoning_content"], m["reasoning_content"]);
    assert_eq!(choices[0]["finish_reason"], plain["choices"][0]["finish_reason"]);
    assert_eq!(usage.unwrap(), plain["usage"]);
    // The finish chunk has an empty delta; the usage chunk precedes [DONE].
    let fin: Json = serde_json::from_str(&events[events.len() - 3]).unwrap();
    assert_eq!(fin["choices"][0]["delta"], json!({}));
    assert_eq!(fin["choices"][0]["finish_reason"], "stop");
    // Without include_usage there is no usage anywhere.
    let (_, _, body) = h
        .raw(Request::post("/v1/chat/completions").body(Body::from(chat_body(json!({"stream": true})).to_string())).unwrap())
        .await;
    for e in sse_events(&body).iter().filter(|e| *e != "[DONE]") {
        let c: Json = serde_json::from_str(e).unwrap();
        assert!(c.get("usage").is_none(), "{e}");
    }
}

fn weather_tools() -> Json {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}])
}

const TOOL_OUTPUT: &str = "Need weather.</think>\n\nChecking.\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris</parameter>\n<parameter name=\"days\">3</parameter>\n</invoke>\n</minimax:tool_call>";

#[tokio::test]
async fn tool_calls_parsed_streamed_and_equal() {
    let h = Harness::saying(TOOL_OUTPUT);
    let (s, v) = h.post_json("/v1/chat/completions", chat_body(json!({"tools": weather_tools()}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls");
    assert_eq!(c["message"]["reasoning_content"], "Need weather.");
    let calls = c["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Json = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris", "days": 3}));
    let content = c["message"]["content"].as_str().unwrap();
    assert!(content.starts_with("Checking."), "{content:?}");
    assert!(!content.contains("<minimax:tool_call>"));

    let (_, _, body) = h
        .raw(Request::post("/v1/chat/completions")
            .body(Body::from(chat_body(json!({"tools": weather_tools(), "stream": true})).to_string()))
            .unwrap())
        .await;
    let (choices, _) = assemble_chat(&sse_events(&body));
    let sc = &choices[0];
    assert_eq!(sc["finish_reason"], "tool_calls");
    assert_eq!(sc["message"]["content"], c["message"]["content"]);
    let scalls = sc["tool_calls"].as_array().unwrap();
    assert_eq!(scalls.len(), 1);
    assert_eq!(scalls[0]["function"], calls[0]["function"]);

    // Without tools the XML stays content.
    let (_, v) = h.post_json("/v1/chat/completions", chat_body(json!({}))).await;
    assert!(v["choices"][0]["message"]["content"].as_str().unwrap().contains("<invoke name=\"get_weather\">"));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn tool_choice_required_unmet_is_an_error_not_a_pretence() {
    let h = Harness::saying("Hmm.</think>\n\nNo tool for you.");
    let (s, v) = h.post_json("/v1/chat/completions", chat_body(json!({"tools": weather_tools(), "tool_choice": "required"}))).await;
    assert_eq!(s, StatusCode::BAD_GATEWAY, "{v}");
    assert_eq!(v["error"]["code"], "tool_choice_unmet");
    assert_eq!(v["error"]["param"], "tool_choice");
}

#[tokio::test]
async fn stop_strings_split_across_tokens_are_not_returned() {
    let h = Harness::saying("r</think>\n\nalpha beta STOP gamma");
    for stream in [false, true] {
        let body = chat_body(json!({"stop": ["STOP", "zzz"], "stream": stream}));
        let (s, b) = h.post("/v1/chat/completions", &body.to_string()).await;
        assert_eq!(s, StatusCode::OK);
        let (content, finish) = if stream {
            let (c, _) = assemble_chat(&sse_events(&b));
            (c[0]["message"]["content"].clone(), c[0]["finish_reason"].clone())
        } else {
            let v: Json = serde_json::from_str(&b).unwrap();
            (v["choices"][0]["message"]["content"].clone(), v["choices"][0]["finish_reason"].clone())
        };
        assert_eq!(content, "alpha beta ", "stream={stream}");
        assert_eq!(finish, "stop");
    }
    // A stop string ends generation: the engine stream was dropped (cancelled).
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(h.fake.live.load(Ordering::SeqCst), 0);
    assert!(h.fake.cancelled.load(Ordering::SeqCst) >= 2);
    // Completions too.
    let (_, v) = h.post_json("/v1/completions", json!({"prompt": "x", "stop": "a c"})).await;
    assert_eq!(v["choices"][0]["text"], "r</think>\n\nalpha beta STOP gamma");
    let (_, v) = h.post_json("/v1/completions", json!({"prompt": "x", "stop": ["ta S"]})).await;
    assert_eq!(v["choices"][0]["text"], "r</think>\n\nalpha be");
}

#[tokio::test]
async fn stop_string_endings_still_report_cached_prompt_tokens() {
    let toks = char_tokens(pipeline().tokenizer(), "alpha STOP beta");
    let h = Harness::new(ApiArgs::default(), move |_, _| Script { cached: 64, ..script(toks.clone()) });
    for stream in [false, true] {
        let mut body = json!({"prompt": "x", "stop": "STOP", "stream": stream});
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        let (s, b) = h.post("/v1/completions", &body.to_string()).await;
        assert_eq!(s, StatusCode::OK);
        let usage = if stream {
            let events: Vec<Json> =
                sse_events(&b).iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect();
            events.into_iter().rev().find(|e| !e["usage"].is_null()).expect("usage chunk")["usage"].clone()
        } else {
            serde_json::from_str::<Json>(&b).unwrap()["usage"].clone()
        };
        assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 64, "stream={stream}: {usage}");
    }
}

#[tokio::test]
async fn length_finish_and_max_tokens() {
    let h = Harness::saying("abcdefghij");
    let (_, v) = h.post_json("/v1/completions", json!({"prompt": "x", "max_tokens": 4})).await;
    assert_eq!(v["choices"][0]["text"], "abcd");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    let (_, v) = h.post_json("/v1/chat/completions", chat_body(json!({"max_completion_tokens": 3, "reasoning_format": "none"}))).await;
    assert_eq!(v["choices"][0]["message"]["content"], "abc");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // max_tokens is clipped to the context.
    let (_, _) = h.post_json("/v1/completions", json!({"prompt": "x", "max_tokens": 1_000_000})).await;
    let req = h.fake.seen.lock().unwrap().last().unwrap().clone();
    assert_eq!(req.max_tokens as usize, 4096 - req.prompt.len());
}

#[tokio::test]
async fn completions_prompt_forms_batches_and_n() {
    let h = Harness::new(ApiArgs::default(), |prompt, req| {
        // Echo the prompt's last character and the seed, so choices are distinguishable.
        let t = format!("[{}|{}]", prompt.chars().last().unwrap_or('_'), req.sampling.seed.unwrap_or(0));
        script(char_tokens(&pipeline().tokenizer().clone(), &t))
    });
    let (s, v) = h.post_json("/v1/completions", json!({"prompt": "hello", "seed": 10})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "[o|10]");
    let ids = h.tok.encode_plain("hey").unwrap();
    let (_, v) = h.post_json("/v1/completions", json!({"prompt": ids, "seed": 1})).await;
    assert_eq!(v["choices"][0]["text"], "[y|1]");
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    // Batch of 3 prompts × n=2: index = prompt × n + i; choice i of a prompt gets seed + i.
    let (s, v) = h.post_json("/v1/completions", json!({"prompt": ["a", "b", ids], "n": 2, "seed": 5})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let texts: Vec<&str> = v["choices"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap()).collect();
    assert_eq!(texts, ["[a|5]", "[a|6]", "[b|5]", "[b|6]", "[y|5]", "[y|6]"]);
    for (i, c) in v["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(c["index"], i);
    }
    let prompt_total: usize = h.fake.seen.lock().unwrap()[2..].iter().step_by(2).map(|r| r.prompt.len()).sum();
    assert_eq!(v["usage"]["prompt_tokens"], prompt_total, "each prompt counted once");
    assert_eq!(v["usage"]["completion_tokens"], 6 * 5);
    // Streaming batch: every index finishes once, then [DONE].
    let (_, b) = h.post("/v1/completions", &json!({"prompt": ["a", "b"], "n": 2, "stream": true, "seed": 5}).to_string()).await;
    let events = sse_events(&b);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let mut texts = vec![String::new(); 4];
    let mut finished = [0; 4];
    for e in &events[..events.len() - 1] {
        let c: Json = serde_json::from_str(e).unwrap();
        let ch = &c["choices"][0];
        let i = ch["index"].as_u64().unwrap() as usize;
        texts[i].push_str(ch["text"].as_str().unwrap());
        if !ch["finish_reason"].is_null() {
            finished[i] += 1;
        }
    }
    assert_eq!(texts, ["[a|5]", "[a|6]", "[b|5]", "[b|6]"]);
    assert_eq!(finished, [1; 4]);
}

#[tokio::test]
async fn chat_n_choices_stream() {
    let h = Harness::new(ApiArgs::default(), |_, req| {
        script(char_tokens(pipeline().tokenizer(), &format!("r</think>\n\nseed {}", req.sampling.seed.unwrap())))
    });
    let (_, b) = h.post("/v1/chat/completions", &chat_body(json!({"n": 3, "seed": 100, "stream": true})).to_string()).await;
    let (choices, _) = assemble_chat(&sse_events(&b));
    let got: Vec<&str> = choices.iter().map(|c| c["message"]["content"].as_str().unwrap()).collect();
    assert_eq!(got, ["seed 100", "seed 101", "seed 102"]);
    let (_, v) = h.post_json("/v1/chat/completions", chat_body(json!({"n": 3, "seed": 100}))).await;
    let got: Vec<&str> = v["choices"].as_array().unwrap().iter().map(|c| c["message"]["content"].as_str().unwrap()).collect();
    assert_eq!(got, ["seed 100", "seed 101", "seed 102"]);
}

#[tokio::test]
async fn logprobs_shapes() {
    let h = Harness::saying("r</think>\n\nok");
    let (_, v) = h.post_json("/v1/chat/completions", chat_body(json!({"logprobs": true, "top_logprobs": 2}))).await;
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), v["usage"]["completion_tokens"].as_u64().unwrap() as usize);
    assert_eq!(content[0]["logprob"], -0.5);
    assert!(content[0]["token"].is_string() && content[0]["bytes"].is_array());
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
    let req = h.fake.seen.lock().unwrap()[0].clone();
    assert!(req.sampling.logprobs);
    assert_eq!(req.sampling.top_logprobs, 2);
    // Streaming carries the same entries, spread over chunks.
    let (_, b) = h.post("/v1/chat/completions", &chat_body(json!({"logprobs": true, "top_logprobs": 2, "stream": true})).to_string()).await;
    let mut n = 0;
    for e in sse_events(&b).iter().filter(|e| *e != "[DONE]") {
        let c: Json = serde_json::from_str(e).unwrap();
        if let Some(a) = c["choices"][0]["logprobs"]["content"].as_array() {
            n += a.len();
        }
    }
    assert_eq!(n, content.len());
    let (_, v) = h.post_json("/v1/completions", json!({"prompt": "x", "logprobs": 1})).await;
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), lp["token_logprobs"].as_array().unwrap().len());
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 1);
    assert_eq!(lp["text_offset"][0], 0);
}

#[tokio::test]
async fn errors_have_openai_bodies_and_statuses() {
    let h = Harness::saying("ok");
    let check = |s: StatusCode, v: &Json, status: u16, param: Option<&str>| {
        assert_eq!(s.as_u16(), status, "{v}");
        let e = &v["error"];
        assert!(e["message"].is_string() && e["type"].is_string(), "{v}");
        assert!(e.as_object().unwrap().contains_key("param") && e.as_object().unwrap().contains_key("code"), "{v}");
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{v}");
        }
    };
    // Malformed JSON, wrong top-level type, empty body.
    for body in ["{not json", "[1,2]", "", "\"str\""] {
        let (s, b) = h.post("/v1/chat/completions", body).await;
        check(s, &serde_json::from_str(&b).unwrap(), 400, None);
    }
    let cases = [
        (json!({"messages": "hi"}), "messages"),
        (json!({}), "messages"),
        (json!({"messages": [{"role": "wizard", "content": "x"}]}), "messages[0].role"),
        (json!({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}), "temperature"),
        (json!({"messages": [{"role": "user", "content": "x"}], "n": 0}), "n"),
        (json!({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}}), "response_format.json_schema.schema.not"),
        (json!({"messages": [{"role": "user", "content": "x"}], "functions": []}), "functions"),
        (json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}), ""),
        (json!({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}), "stream"),
    ];
    for (body, param) in cases {
        let (s, v) = h.post_json("/v1/chat/completions", body.clone()).await;
        check(s, &v, 400, if param.is_empty() { None } else { Some(param) });
    }
    let (s, v) = h.post_json("/v1/completions", json!({"prompt": "x", "echo": true})).await;
    check(s, &v, 400, Some("echo"));
    assert_eq!(v["error"]["code"], "unsupported_value");
    let (s, v) = h.post_json("/v1/completions", json!({"prompt": "x", "suffix": "y"})).await;
    check(s, &v, 400, Some("suffix"));
    let (s, v) = h.post_json("/v1/completions", json!({"prompt": [1, 99999]})).await;
    check(s, &v, 400, Some("prompt[1]"));
    // Prompt longer than the context: 400, not 503.
    let (s, v) = h.post_json("/v1/completions", json!({"prompt": vec![5; 5000]})).await;
    check(s, &v, 400, Some("prompt"));
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    // Unknown model and route: 404.
    let (s, v) = h.post_json("/v1/chat/completions", json!({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})).await;
    check(s, &v, 404, Some("model"));
    assert_eq!(v["error"]["code"], "model_not_found");
    let (s, b) = h.get("/v1/nothing").await;
    check(s, &serde_json::from_str(&b).unwrap(), 404, None);
    let (s, b) = h.get("/v1/chat/completions").await;
    check(s, &serde_json::from_str(&b).unwrap(), 405, None);
    // Unknown fields are ignored.
    let (s, _) = h.post_json("/v1/chat/completions", chat_body(json!({"some_future_field": {"x": 1}}))).await;
    assert_eq!(s, StatusCode::OK);
    // The server keeps serving.
    let (s, _) = h.post_json("/v1/chat/completions", chat_body(json!({}))).await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test]
async fn body_limit_is_413() {
    let args = ApiArgs { max_body_bytes: 1000, ..ApiArgs::default() };
    let h = Harness::saying_with(args, "ok");
    let big = json!({"messages": [{"role": "user", "content": "x".repeat(5000)}]}).to_string();
    let (s, b) = h.post("/v1/chat/completions", &big).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{b}");
    let v: Json = serde_json::from_str(&b).unwrap();
    assert_eq!(v["error"]["code"], "request_too_large");
    // Chunked (no content-length) too.
    let chunks = futures_util::stream::iter((0..10).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b' '; 200]))));
    let req = Request::post("/v1/chat/completions").body(Body::from_stream(chunks)).unwrap();
    let (s, _, _) = h.raw(req).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn api_key_required_on_v1_only() {
    let args = ApiArgs { api_key: Some("sekrit".into()), ..ApiArgs::default() };
    let h = Harness::saying_with(args, "ok");
    let (s, b) = h.post("/v1/chat/completions", &chat_body(json!({})).to_string()).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "{b}");
    let v: Json = serde_json::from_str(&b).unwrap();
    assert_eq!(v["error"]["type"], "authentication_error");
    for key in ["Bearer wrong", "sekrit", "Basic sekrit"] {
        let req = Request::get("/v1/models").header("authorization", key).body(Body::empty()).unwrap();
        assert_eq!(h.raw(req).await.0, StatusCode::UNAUTHORIZED, "{key}");
    }
    let req = Request::get("/v1/models").header("authorization", "Bearer sekrit").body(Body::empty()).unwrap();
    assert_eq!(h.raw(req).await.0, StatusCode::OK);
    assert_eq!(h.get("/health").await.0, StatusCode::OK);
    assert_eq!(h.get("/metrics").await.0, StatusCode::OK);
}

#[tokio::test]
async fn engine_refusals_map_to_statuses() {
    let h = Harness::saying("ok");
    for (e, status) in [
        (EngineError::QueueFull(64), 429),
        (EngineError::NotReady("rank 1 loading".into()), 503),
        (EngineError::PromptTooLong { prompt: 5000, context: 4096 }, 400),
        (EngineError::Internal("bug".into()), 500),
    ] {
        *h.fake.refuse.lock().unwrap() = Some(e);
        for stream in [false, true] {
            let (s, b) = h.post("/v1/chat/completions", &chat_body(json!({"stream": stream})).to_string()).await;
            assert_eq!(s.as_u16(), status, "{b}");
            let v: Json = serde_json::from_str(&b).unwrap();
            assert!(v["error"]["message"].is_string());
        }
    }
    *h.fake.refuse.lock().unwrap() = None;
    // A failure before the first token is a status even when streaming.
    let h = Harness::new(ApiArgs::default(), |_, _| Script { fail: Some(EngineError::RankFailure("rank 1 died".into())), ..script(vec![]) });
    let (s, b) = h.post("/v1/chat/completions", &chat_body(json!({"stream": true})).to_string()).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{b}");
    // After tokens were sent it is an error event, without [DONE].
    let toks = char_tokens(pipeline().tokenizer(), "abc");
    let h = Harness::new(ApiArgs::default(), move |_, _| Script { fail: Some(EngineError::RankFailure("rank 1 died".into())), ..script(toks.clone()) });
    let (s, b) = h.post("/v1/chat/completions", &chat_body(json!({"stream": true, "reasoning_format": "none"})).to_string()).await;
    assert_eq!(s, StatusCode::OK);
    let events = sse_events(&b);
    let last: Json = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "rank_failure");
    assert!(!events.iter().any(|e| e == "[DONE]"));
    let (s, _) = h.post("/v1/chat/completions", &chat_body(json!({})).to_string()).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn client_disconnect_cancels_the_sequence() {
    let toks = char_tokens(pipeline().tokenizer(), &"word ".repeat(200));
    let h = Harness::new(ApiArgs::default(), move |_, _| Script { delay: Duration::from_millis(5), ..script(toks.clone()) });
    let req = Request::post("/v1/chat/completions").body(Body::from(chat_body(json!({"stream": true})).to_string())).unwrap();
    let resp = router(h.state.clone()).oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body().into_data_stream();
    let _ = body.next().await.unwrap().unwrap();
    let _ = body.next().await.unwrap().unwrap();
    assert_eq!(h.fake.live.load(Ordering::SeqCst), 1);
    drop(body);
    assert_eq!(h.fake.live.load(Ordering::SeqCst), 0, "dropping the response body drops the engine stream");
    assert_eq!(h.fake.cancelled.load(Ordering::SeqCst), 1);
    let (_, m) = h.get("/metrics").await;
    assert!(m.contains("minimax_requests_cancelled_total 1\n"), "{m}");
}

#[tokio::test]
async fn timeout_cancels_and_answers_504() {
    let toks = char_tokens(pipeline().tokenizer(), &"word ".repeat(100));
    let args = ApiArgs { request_timeout: 0.2, ..ApiArgs::default() };
    let h = Harness::new(args, move |_, _| Script { delay: Duration::from_millis(20), ..script(toks.clone()) });
    let (s, b) = h.post("/v1/completions", &json!({"prompt": "x"}).to_string()).await;
    assert_eq!(s, StatusCode::GATEWAY_TIMEOUT, "{b}");
    assert_eq!(h.fake.live.load(Ordering::SeqCst), 0);
    let (s, b) = h.post("/v1/completions", &json!({"prompt": "x", "stream": true}).to_string()).await;
    assert_eq!(s, StatusCode::OK);
    let last: Json = serde_json::from_str(sse_events(&b).last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "timeout");
}

#[tokio::test]
async fn models_health_metrics_perplexity() {
    let h = Harness::saying("ok");
    let (s, b) = h.get("/v1/models").await;
    assert_eq!(s, StatusCode::OK);
    let v: Json = serde_json::from_str(&b).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "m2-small");
    assert_eq!(v["data"][0]["context_length"], 4096);
    assert_eq!(v["data"][0]["owned_by"], "minimax-serve");
    assert_eq!(h.get("/v1/models/m2-small").await.0, StatusCode::OK);
    assert_eq!(h.get("/v1/models/other").await.0, StatusCode::NOT_FOUND);

    let (s, b) = h.get("/health").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(serde_json::from_str::<Json>(&b).unwrap()["status"], "ok");
    h.fake.health.lock().unwrap()[1].state = "loading".into();
    h.fake.health.lock().unwrap()[1].progress = 0.4;
    let (s, b) = h.get("/health").await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    let v: Json = serde_json::from_str(&b).unwrap();
    assert_eq!(v["status"], "loading");
    assert_eq!(v["ranks"][1]["state"], "loading");
    assert!((v["ranks"][1]["progress"].as_f64().unwrap() - 0.4).abs() < 1e-6);

    let ids = h.tok.encode_plain("hello world").unwrap();
    let (s, v) = h.post_json("/v1/perplexity", json!({"prompt": [ids.clone(), "abc"]})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let d = &v["data"][0];
    assert_eq!(d["tokens"], json!(ids));
    assert!(d["logprobs"][0].is_null());
    assert_eq!(d["logprobs"].as_array().unwrap().len(), ids.len());
    let nll: f64 = (1..ids.len()).map(|i| i as f64 / 10.0).sum();
    assert!((d["nll"].as_f64().unwrap() - nll).abs() < 1e-4);
    let ppl = (nll / (ids.len() - 1) as f64).exp();
    assert!((d["perplexity"].as_f64().unwrap() - ppl).abs() < 1e-3);
    let (s, v) = h.post_json("/v1/perplexity", json!({"prompt": [5]})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");

    h.post_json("/v1/chat/completions", chat_body(json!({}))).await;
    h.post_json("/v1/chat/completions", json!({"messages": 1})).await;
    let (s, m) = h.get("/metrics").await;
    assert_eq!(s, StatusCode::OK);
    for needle in [
        "minimax_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 1",
        "minimax_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"} 1",
        "minimax_generation_tokens_total 2",
        "# TYPE minimax_time_to_first_token_seconds histogram",
        "minimax_time_to_first_token_seconds_count 1",
        "minimax_inter_token_latency_seconds_count 1",
        "minimax_queue_depth 0",
        "minimax_running_sequences",
        "minimax_kv_pages_used",
        "minimax_kv_pages_free 100",
        "minimax_prefix_cache_hit_ratio",
        "minimax_rank_restarts_total 0",
    ] {
        assert!(m.contains(needle), "missing {needle}:\n{m}");
    }
}

#[tokio::test]
async fn concurrent_requests_all_succeed_and_match_sequential() {
    let h = Harness::new(ApiArgs::default(), |prompt, req| {
        let t = format!("{}#{}", prompt.len(), req.sampling.seed.unwrap_or(0));
        Script { delay: Duration::from_millis(1), ..script(char_tokens(pipeline().tokenizer(), &t)) }
    });
    let body = |i: usize| json!({"prompt": format!("prompt {i}"), "seed": i, "max_tokens": 50});
    let mut seq = Vec::new();
    for i in 0..32 {
        seq.push(h.post_json("/v1/completions", body(i)).await.1["choices"][0]["text"].clone());
    }
    let futs = (0..32).map(|i| {
        let h = &h;
        async move { h.post_json("/v1/completions", body(i)).await }
    });
    let res = futures_util::future::join_all(futs).await;
    for (i, (s, v)) in res.into_iter().enumerate() {
        assert_eq!(s, StatusCode::OK);
        assert_eq!(v["choices"][0]["text"], seq[i]);
    }
}

#[tokio::test]
async fn chunked_reading_of_body_works() {
    let h = Harness::saying("ok");
    let body = chat_body(json!({})).to_string();
    let parts: Vec<_> = body.as_bytes().chunks(7).map(|c| Ok::<_, std::io::Error>(bytes::Bytes::copy_from_slice(c))).collect();
    let req = Request::post("/v1/chat/completions").body(Body::from_stream(futures_util::stream::iter(parts))).unwrap();
    let (s, _, b) = h.raw(req).await;
    assert_eq!(s, StatusCode::OK, "{b}");
}
