//! The Responses API's event stream, and the response object: `response.created`,
//! `response.in_progress`, then output items in the order the model writes them (a `reasoning`
//! item with its `reasoning_text`, a `message` item with its `output_text`, one
//! `function_call` item per call), each `response.output_item.added` ... deltas ...
//! `*.done` ... `response.output_item.done`; then `response.completed` (or
//! `response.incomplete` when `max_output_tokens` cut it) carrying the whole response. Every
//! event has a `sequence_number` and is framed `event: <type>` + `data: <json>`; no `[DONE]`.

use std::cell::Cell;

use bytes::Bytes;
use serde_json::{Value as Json, json};

use super::request::ResponsesParams;
use crate::api::error::ApiError;
use crate::api::run::Update;
use crate::api::sse::ChunkEncoder;
use crate::engine::Usage;
use crate::text::output::Delta;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Reasoning,
    Message,
    /// A call, by its index among the calls.
    Call(usize),
    /// A call of a `custom` (freeform) tool: its input goes out raw, at its end.
    Custom(usize),
}

/// The output item being written.
struct Open {
    kind: Kind,
    id: String,
    output_index: usize,
    /// Reasoning or message text, or a call's arguments.
    text: String,
    call_id: String,
    name: String,
}

/// Encodes one response's updates as Responses events; [`ResponseEncoder::response`] is the
/// response object (the non-streamed answer is the one the stream completes with).
pub struct ResponseEncoder {
    id: String,
    created_at: u64,
    model: String,
    params: ResponsesParams,
    seq: Cell<u64>,
    open: Option<Open>,
    /// Finished output items.
    output: Vec<Json>,
    /// Whitespace written outside a message item, held until text follows.
    pending_ws: String,
    /// Every call started so far, by index: its kind, id and name (arguments that arrive
    /// after another item opened reopen the right one).
    calls: Vec<(usize, Kind, String, String)>,
    incomplete: bool,
}

impl ResponseEncoder {
    pub fn new(id: String, created_at: u64, model: String, params: ResponsesParams) -> Self {
        Self { id, created_at, model, params, seq: Cell::new(0), open: None, output: Vec::new(), pending_ws: String::new(), calls: Vec::new(), incomplete: false }
    }

    /// An event of `kind` with the next sequence number.
    fn event(&self, kind: &str, mut body: Json) -> Json {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.seq.get());
        self.seq.set(self.seq.get() + 1);
        body
    }

    /// The response object in its current state.
    pub fn response(&self, status: &str, usage: Option<&Usage>) -> Json {
        let p = &self.params;
        json!({
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "model": self.model,
            "output": self.output, "error": null,
            "incomplete_details": if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Json::Null },
            "instructions": p.instructions, "max_output_tokens": p.max_output_tokens, "metadata": p.metadata,
            "parallel_tool_calls": p.parallel_tool_calls, "tool_choice": p.tool_choice, "tools": p.tools,
            "temperature": p.sampling.temperature, "top_p": p.sampling.top_p, "store": false,
            "text": {"format": p.text_format},
            "usage": usage.map(usage_json),
        })
    }

    fn item(&self, o: &Open, status: &str) -> Json {
        match o.kind {
            Kind::Reasoning => {
                let done = status != "in_progress";
                let content = if done { json!([{"type": "reasoning_text", "text": o.text}]) } else { json!([]) };
                let summary = if done && self.params.summary { json!([{"type": "summary_text", "text": o.text}]) } else { json!([]) };
                json!({"id": o.id, "type": "reasoning", "summary": summary, "content": content, "status": status})
            }
            Kind::Message => {
                let content = if status == "in_progress" { json!([]) } else { json!([text_part(&o.text)]) };
                json!({"id": o.id, "type": "message", "role": "assistant", "status": status, "content": content})
            }
            Kind::Call(_) => {
                let args = if status == "in_progress" { "" } else { o.text.as_str() };
                let mut item = json!({"id": o.id, "type": "function_call", "call_id": o.call_id, "name": o.name, "arguments": args, "status": status});
                // A namespace's function goes back under its own name and namespace.
                if let Some((_, ns, name)) = self.params.namespaced.iter().find(|n| n.0 == o.name) {
                    item["name"] = json!(name);
                    item["namespace"] = json!(ns);
                }
                item
            }
            Kind::Custom(_) => {
                let input = if status == "in_progress" { String::new() } else { custom_input(&o.text) };
                json!({"id": o.id, "type": "custom_tool_call", "call_id": o.call_id, "name": o.name, "input": input, "status": status})
            }
        }
    }

    /// Closes the open item: `completed`, or `incomplete` when the length limit cut it.
    fn close(&mut self, out: &mut Vec<Json>) {
        self.close_as("completed", out);
    }

    fn close_as(&mut self, status: &str, out: &mut Vec<Json>) {
        let Some(o) = self.open.take() else { return };
        let (id, oi) = (o.id.as_str(), o.output_index);
        match o.kind {
            Kind::Reasoning if self.params.summary => {
                let part = json!({"type": "summary_text", "text": o.text});
                out.push(self.event("response.reasoning_summary_text.done", json!({"item_id": id, "output_index": oi, "summary_index": 0, "text": o.text})));
                out.push(self.event("response.reasoning_summary_part.done", json!({"item_id": id, "output_index": oi, "summary_index": 0, "part": part})));
            }
            Kind::Reasoning => {
                let part = json!({"type": "reasoning_text", "text": o.text});
                out.push(self.event("response.reasoning_text.done", json!({"item_id": id, "output_index": oi, "content_index": 0, "text": o.text})));
                out.push(self.event("response.content_part.done", json!({"item_id": id, "output_index": oi, "content_index": 0, "part": part})));
            }
            Kind::Message => {
                out.push(self.event("response.output_text.done", json!({"item_id": id, "output_index": oi, "content_index": 0, "text": o.text, "logprobs": []})));
                out.push(self.event("response.content_part.done", json!({"item_id": id, "output_index": oi, "content_index": 0, "part": text_part(&o.text)})));
            }
            Kind::Call(_) => {
                // The name the item carries (a namespace's function by its own name).
                let name = self.params.namespaced.iter().find(|n| n.0 == o.name).map_or(o.name.as_str(), |n| n.2.as_str());
                out.push(self.event("response.function_call_arguments.done", json!({"item_id": id, "output_index": oi, "name": name, "arguments": o.text})));
            }
            Kind::Custom(_) => {
                let input = custom_input(&o.text);
                out.push(self.event("response.custom_tool_call_input.delta", json!({"item_id": id, "output_index": oi, "delta": input})));
                out.push(self.event("response.custom_tool_call_input.done", json!({"item_id": id, "output_index": oi, "input": input})));
            }
        }
        let item = self.item(&o, status);
        out.push(self.event("response.output_item.done", json!({"output_index": oi, "item": item})));
        self.output.push(item);
    }

    /// Makes an item of `kind` the open one (closing another); `call`: a call's id and name.
    fn ensure(&mut self, kind: Kind, call: Option<(&str, &str)>, out: &mut Vec<Json>) {
        if self.open.as_ref().is_some_and(|o| o.kind == kind) {
            return;
        }
        self.close(out);
        if kind != Kind::Message {
            self.pending_ws.clear();
        }
        let output_index = self.output.len();
        let prefix = match kind {
            Kind::Reasoning => "rs",
            Kind::Message => "msg",
            Kind::Call(_) => "fc",
            Kind::Custom(_) => "ctc",
        };
        let suffix = self.id.rsplit(['-', '_']).next().unwrap_or("");
        let (call_id, name) = call.map(|(c, n)| (c.to_string(), n.to_string())).unwrap_or_default();
        let o = Open { kind, id: format!("{prefix}_{suffix}{output_index}"), output_index, text: String::new(), call_id, name };
        let item = self.item(&o, "in_progress");
        out.push(self.event("response.output_item.added", json!({"output_index": output_index, "item": item})));
        match kind {
            Kind::Reasoning if self.params.summary => {
                let ev = json!({"item_id": o.id, "output_index": output_index, "summary_index": 0, "part": {"type": "summary_text", "text": ""}});
                out.push(self.event("response.reasoning_summary_part.added", ev));
            }
            Kind::Reasoning => {
                let ev = json!({"item_id": o.id, "output_index": output_index, "content_index": 0, "part": {"type": "reasoning_text", "text": ""}});
                out.push(self.event("response.content_part.added", ev));
            }
            Kind::Message => {
                let ev = json!({"item_id": o.id, "output_index": output_index, "content_index": 0, "part": text_part("")});
                out.push(self.event("response.content_part.added", ev));
            }
            Kind::Call(_) | Kind::Custom(_) => {}
        }
        self.open = Some(o);
    }
}

/// A custom tool's raw input from the arguments the model wrote (`{"input": "..."}`); other
/// JSON goes out as its text.
fn custom_input(arguments: &str) -> String {
    match serde_json::from_str::<Json>(arguments) {
        Ok(Json::Object(o)) if o.len() == 1 && o.get("input").is_some_and(Json::is_string) => o["input"].as_str().unwrap_or("").to_string(),
        _ => arguments.to_string(),
    }
}

fn text_part(text: &str) -> Json {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// The Responses `usage`.
pub fn usage_json(u: &Usage) -> Json {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

impl ChunkEncoder for ResponseEncoder {
    fn start(&mut self) -> Vec<Json> {
        let r = self.response("in_progress", None);
        vec![self.event("response.created", json!({"response": r})), self.event("response.in_progress", json!({"response": r}))]
    }

    fn update(&mut self, u: Update) -> Result<Vec<Json>, ApiError> {
        let mut out = Vec::new();
        for d in u.deltas {
            match d {
                Delta::Reasoning(t) if !t.is_empty() => {
                    self.ensure(Kind::Reasoning, None, &mut out);
                    let o = self.open.as_mut().expect("just opened");
                    o.text.push_str(&t);
                    let ev = if self.params.summary {
                        ("response.reasoning_summary_text.delta", json!({"item_id": o.id, "output_index": o.output_index, "summary_index": 0, "delta": t}))
                    } else {
                        ("response.reasoning_text.delta", json!({"item_id": o.id, "output_index": o.output_index, "content_index": 0, "delta": t}))
                    };
                    out.push(self.event(ev.0, ev.1));
                }
                Delta::Content(t) if !t.is_empty() => {
                    if !self.open.as_ref().is_some_and(|o| o.kind == Kind::Message) && t.trim().is_empty() {
                        self.pending_ws.push_str(&t);
                        continue;
                    }
                    self.ensure(Kind::Message, None, &mut out);
                    let text = std::mem::take(&mut self.pending_ws) + &t;
                    let o = self.open.as_mut().expect("just opened");
                    o.text.push_str(&text);
                    let ev = json!({"item_id": o.id, "output_index": o.output_index, "content_index": 0, "delta": text, "logprobs": []});
                    out.push(self.event("response.output_text.delta", ev));
                }
                Delta::ToolCallStart { index, id, name } => {
                    self.close(&mut out);
                    let kind = if self.params.custom_tools.contains(&name) { Kind::Custom(index) } else { Kind::Call(index) };
                    self.calls.push((index, kind, id.clone(), name.clone()));
                    self.ensure(kind, Some((&id, &name)), &mut out);
                }
                Delta::ToolCallArguments { index, chunk } if !chunk.is_empty() => {
                    if !self.open.as_ref().is_some_and(|o| matches!(o.kind, Kind::Call(i) | Kind::Custom(i) if i == index)) {
                        let (kind, id, name) = match self.calls.iter().find(|c| c.0 == index) {
                            Some((_, k, id, name)) => (*k, id.clone(), name.clone()),
                            None => (Kind::Call(index), String::new(), String::new()),
                        };
                        self.ensure(kind, Some((&id, &name)), &mut out);
                    }
                    let o = self.open.as_mut().expect("just opened");
                    o.text.push_str(&chunk);
                    if let Kind::Call(_) = o.kind {
                        let ev = json!({"item_id": o.id, "output_index": o.output_index, "delta": chunk});
                        out.push(self.event("response.function_call_arguments.delta", ev));
                    }
                }
                _ => {}
            }
        }
        if let Some(end) = u.end {
            if let Some(err) = end.chat.as_ref().and_then(|f| f.tool_choice_error.as_ref()) {
                return Err(crate::api::chat::tool_choice_error(&err.0));
            }
            self.incomplete = end.reason == "length";
            self.close_as(if self.incomplete { "incomplete" } else { "completed" }, &mut out);
        }
        Ok(out)
    }

    fn finish(&mut self, usage: &Usage) -> Vec<Json> {
        let (kind, status) = if self.incomplete { ("response.incomplete", "incomplete") } else { ("response.completed", "completed") };
        let r = self.response(status, Some(usage));
        vec![self.event(kind, json!({"response": r}))]
    }

    fn frame(&self, chunk: &Json) -> Bytes {
        let kind = chunk.get("type").and_then(Json::as_str).unwrap_or("message");
        Bytes::from(format!("event: {kind}\ndata: {chunk}\n\n"))
    }

    fn end(&self) -> Option<Bytes> {
        None
    }

    fn error(&self, e: &ApiError) -> Json {
        let mut r = self.response("failed", None);
        r["error"] = json!({"code": e.code.unwrap_or(e.kind), "message": e.message});
        self.event("response.failed", json!({"response": r}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::run::ChoiceEnd;

    fn params() -> ResponsesParams {
        ResponsesParams {
            model: None,
            max_output_tokens: None,
            stream: true,
            sampling: Default::default(),
            instructions: None,
            tools: json!([]),
            tool_choice: json!("auto"),
            parallel_tool_calls: true,
            metadata: Json::Null,
            custom_tools: vec!["apply_patch".into()],
            namespaced: vec![("mcp__docs__search".into(), "mcp__docs".into(), "search".into())],
            summary: false,
            text_format: json!({"type": "text"}),
            format: None,
        }
    }

    fn update(deltas: Vec<Delta>, end: Option<ChoiceEnd>) -> Update {
        Update { slot: 0, index: 0, deltas, logprobs: Vec::new(), end }
    }

    #[test]
    fn items_follow_the_deltas_and_the_response_holds_them() {
        let mut e = ResponseEncoder::new("resp-abc".into(), 7, "m".into(), params());
        let mut all = e.start();
        all.extend(
            e.update(update(
                vec![
                    Delta::Reasoning("Use ".into()),
                    Delta::Reasoning("ls.".into()),
                    Delta::Content("\n\n".into()),
                    Delta::Content("Listing.".into()),
                    Delta::ToolCallStart { index: 0, id: "call_1".into(), name: "shell".into() },
                    Delta::ToolCallArguments { index: 0, chunk: "{\"command\":".into() },
                    Delta::ToolCallArguments { index: 0, chunk: "[\"ls\"]}".into() },
                ],
                None,
            ))
            .unwrap(),
        );
        all.extend(e.update(update(vec![], Some(ChoiceEnd { reason: "tool_calls", usage: Usage::default(), chat: None, stop_sequence: None }))).unwrap());
        all.extend(e.finish(&Usage { prompt_tokens: 10, completion_tokens: 5, cached_tokens: 4 }));
        let types: Vec<&str> = all.iter().map(|v| v["type"].as_str().unwrap()).collect();
        assert_eq!(
            types,
            [
                "response.created", "response.in_progress",
                "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
                "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                // The held whitespace goes out with the text: one delta.
                "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                "response.output_text.done", "response.content_part.done", "response.output_item.done",
                "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.delta",
                "response.function_call_arguments.done", "response.output_item.done",
                "response.completed",
            ]
        );
        let seqs: Vec<u64> = all.iter().map(|v| v["sequence_number"].as_u64().unwrap()).collect();
        assert_eq!(seqs, (0..all.len() as u64).collect::<Vec<_>>());
        let r = &all.last().unwrap()["response"];
        assert_eq!(r["status"], "completed");
        let out = r["output"].as_array().unwrap();
        assert_eq!(out[0]["content"], json!([{"type": "reasoning_text", "text": "Use ls."}]));
        // The whitespace between reasoning and text stays with the text that follows it.
        assert_eq!(out[1]["content"][0]["text"], "\n\nListing.");
        assert_eq!(out[2]["call_id"], "call_1");
        assert_eq!(out[2]["arguments"], "{\"command\":[\"ls\"]}");
        assert_eq!(r["usage"]["input_tokens_details"]["cached_tokens"], 4);
        assert_eq!(r["usage"]["total_tokens"], 15);
    }

    /// A freeform tool's call goes out as a `custom_tool_call` with the raw input.
    #[test]
    fn a_custom_tool_call_carries_the_raw_input() {
        let mut e = ResponseEncoder::new("resp-c".into(), 7, "m".into(), params());
        let patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n";
        let args = json!({"input": patch}).to_string();
        let (a, b) = args.split_at(10);
        let mut all = e
            .update(update(
                vec![
                    Delta::ToolCallStart { index: 0, id: "call_p".into(), name: "apply_patch".into() },
                    Delta::ToolCallArguments { index: 0, chunk: a.into() },
                    Delta::ToolCallArguments { index: 0, chunk: b.into() },
                ],
                Some(ChoiceEnd { reason: "tool_calls", usage: Usage::default(), chat: None, stop_sequence: None }),
            ))
            .unwrap();
        all.extend(e.finish(&Usage::default()));
        let types: Vec<&str> = all.iter().map(|v| v["type"].as_str().unwrap()).collect();
        assert_eq!(
            types,
            ["response.output_item.added", "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done", "response.output_item.done", "response.completed"]
        );
        let item = &all[3]["item"];
        assert_eq!((item["type"].as_str(), item["call_id"].as_str(), item["input"].as_str()), (Some("custom_tool_call"), Some("call_p"), Some(patch)));
    }

    /// Asked for a summary, the reasoning streams as summary text and the item holds both.
    #[test]
    fn a_summary_streams_the_reasoning() {
        let mut e = ResponseEncoder::new("resp-s".into(), 7, "m".into(), ResponsesParams { summary: true, ..params() });
        let out = e
            .update(update(vec![Delta::Reasoning("Think.".into()), Delta::Content("Done.".into())], Some(ChoiceEnd { reason: "stop", usage: Usage::default(), chat: None, stop_sequence: None })))
            .unwrap();
        let types: Vec<&str> = out.iter().take(5).map(|v| v["type"].as_str().unwrap()).collect();
        assert_eq!(
            types,
            ["response.output_item.added", "response.reasoning_summary_part.added", "response.reasoning_summary_text.delta", "response.reasoning_summary_text.done", "response.reasoning_summary_part.done"]
        );
        let item = &out[5]["item"];
        assert_eq!((item["summary"][0]["text"].as_str(), item["content"][0]["text"].as_str()), (Some("Think."), Some("Think.")));
    }

    /// A namespace's function call goes out under its own name with its namespace, in every
    /// event.
    #[test]
    fn a_namespace_call_names_its_namespace() {
        let mut e = ResponseEncoder::new("resp-n".into(), 7, "m".into(), params());
        let out = e
            .update(update(
                vec![Delta::ToolCallStart { index: 0, id: "c".into(), name: "mcp__docs__search".into() }, Delta::ToolCallArguments { index: 0, chunk: "{}".into() }],
                Some(ChoiceEnd { reason: "tool_calls", usage: Usage::default(), chat: None, stop_sequence: None }),
            ))
            .unwrap();
        let done = out.iter().find(|v| v["type"] == "response.output_item.done").unwrap();
        assert_eq!((done["item"]["name"].as_str(), done["item"]["namespace"].as_str()), (Some("search"), Some("mcp__docs")));
        assert_eq!(out[0]["item"]["namespace"], "mcp__docs");
        // Every event about it names the function as its item does.
        let args_done = out.iter().find(|v| v["type"] == "response.function_call_arguments.done").unwrap();
        assert_eq!(args_done["name"], "search", "{args_done}");
    }

    #[test]
    fn a_length_cut_is_incomplete_and_a_failure_is_an_event() {
        let mut e = ResponseEncoder::new("resp-x".into(), 7, "m".into(), params());
        e.update(update(vec![Delta::Content("abc".into())], Some(ChoiceEnd { reason: "length", usage: Usage::default(), chat: None, stop_sequence: None }))).unwrap();
        let fin = e.finish(&Usage::default());
        assert_eq!(fin[0]["type"], "response.incomplete");
        assert_eq!(fin[0]["response"]["output"][0]["status"], "incomplete");
        assert_eq!(fin[0]["response"]["output"][0]["content"][0]["text"], "abc");
        assert_eq!(fin[0]["response"]["incomplete_details"]["reason"], "max_output_tokens");
        let f = e.error(&ApiError::timeout(3.0));
        assert_eq!((f["type"].as_str(), f["response"]["status"].as_str()), (Some("response.failed"), Some("failed")));
        assert_eq!(f["response"]["error"]["code"], "timeout");
    }
}
