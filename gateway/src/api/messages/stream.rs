//! The Messages API's event stream: `message_start`, a `ping`, then content blocks in the order
//! the model writes them (`thinking`, `text`, one `tool_use` per call), each opened by
//! `content_block_start`, filled by `content_block_delta` (`thinking_delta`, `text_delta`,
//! `input_json_delta` with the arguments' JSON text as it is parsed) and closed by
//! `content_block_stop`; then `message_delta` (stop reason, usage) and `message_stop`. Every
//! event is framed `event: <type>` + `data: <json>`; no `[DONE]`.

use bytes::Bytes;
use serde_json::{Value as Json, json};

use crate::api::error::ApiError;
use crate::api::run::Update;
use crate::api::sse::ChunkEncoder;
use crate::engine::Usage;
use crate::text::output::Delta;

/// The kind of the open content block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Thinking,
    Text,
    /// A tool call, by its index among the calls.
    Tool(usize),
}

/// Encodes one message's updates as Anthropic stream events (the non-streamed answer is
/// [`assemble`]d from the same events, so both carry the same blocks).
pub struct MessageEncoder {
    id: String,
    model: String,
    prompt_tokens: u32,
    /// The open block and its index; blocks are numbered in the order they open.
    open: Option<(Block, usize)>,
    next_index: usize,
    /// Whitespace written outside any text block, held until text follows (a text block of
    /// whitespace alone is never opened).
    pending_ws: String,
    /// FNV-1a state over the open thinking block's text (its signature).
    thinking_hash: u64,
    stop_reason: &'static str,
    stop_sequence: Option<String>,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// A thinking block's `signature` from the FNV-1a hash of its text: not a cryptographic one
/// (nothing here checks it), but never empty, so clients that drop unsigned thinking blocks
/// send the reasoning back.
fn signature(hash: u64) -> String {
    format!("minimax-serve-{hash:016x}")
}

fn fnv(mut h: u64, text: &str) -> u64 {
    for b in text.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl MessageEncoder {
    pub fn new(id: String, model: String, prompt_tokens: u32) -> Self {
        Self {
            id,
            model,
            prompt_tokens,
            open: None,
            next_index: 0,
            pending_ws: String::new(),
            thinking_hash: FNV_OFFSET,
            stop_reason: "end_turn",
            stop_sequence: None,
        }
    }

    fn close(&mut self, out: &mut Vec<Json>) {
        if let Some((kind, index)) = self.open.take() {
            if kind == Block::Thinking {
                out.push(Self::delta(index, json!({"type": "signature_delta", "signature": signature(self.thinking_hash)})));
                self.thinking_hash = FNV_OFFSET;
            }
            out.push(json!({"type": "content_block_stop", "index": index}));
        }
    }

    /// Opens a block of `kind` unless it is the open one; returns its index.
    fn ensure(&mut self, kind: Block, start: impl FnOnce() -> Json, out: &mut Vec<Json>) -> usize {
        if let Some((k, index)) = self.open
            && k == kind
        {
            return index;
        }
        self.close(out);
        if kind != Block::Text {
            self.pending_ws.clear();
        }
        let index = self.next_index;
        self.next_index += 1;
        self.open = Some((kind, index));
        out.push(json!({"type": "content_block_start", "index": index, "content_block": start()}));
        index
    }

    fn delta(index: usize, delta: Json) -> Json {
        json!({"type": "content_block_delta", "index": index, "delta": delta})
    }
}

impl ChunkEncoder for MessageEncoder {
    fn start(&mut self) -> Vec<Json> {
        let usage = json!({"input_tokens": self.prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0});
        vec![
            json!({"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": null, "stop_sequence": null, "usage": usage,
            }}),
            json!({"type": "ping"}),
        ]
    }

    fn update(&mut self, u: Update) -> Result<Vec<Json>, ApiError> {
        let mut out = Vec::new();
        for d in u.deltas {
            match d {
                Delta::Reasoning(t) if !t.is_empty() => {
                    let i = self.ensure(Block::Thinking, || json!({"type": "thinking", "thinking": "", "signature": ""}), &mut out);
                    self.thinking_hash = fnv(self.thinking_hash, &t);
                    out.push(Self::delta(i, json!({"type": "thinking_delta", "thinking": t})));
                }
                Delta::Content(t) if !t.is_empty() => {
                    if !matches!(self.open, Some((Block::Text, _))) && t.trim().is_empty() {
                        self.pending_ws.push_str(&t);
                        continue;
                    }
                    let i = self.ensure(Block::Text, || json!({"type": "text", "text": ""}), &mut out);
                    let text = std::mem::take(&mut self.pending_ws) + &t;
                    out.push(Self::delta(i, json!({"type": "text_delta", "text": text})));
                }
                Delta::ToolCallStart { index, id, name } => {
                    self.close(&mut out);
                    self.ensure(Block::Tool(index), || json!({"type": "tool_use", "id": id, "name": name, "input": {}}), &mut out);
                }
                Delta::ToolCallArguments { index, chunk } if !chunk.is_empty() => {
                    let i = self.ensure(Block::Tool(index), || json!({"type": "tool_use", "id": "", "name": "", "input": {}}), &mut out);
                    out.push(Self::delta(i, json!({"type": "input_json_delta", "partial_json": chunk})));
                }
                _ => {}
            }
        }
        if let Some(end) = u.end {
            if let Some(err) = end.chat.as_ref().and_then(|f| f.tool_choice_error.as_ref()) {
                return Err(crate::api::chat::tool_choice_error(&err.0));
            }
            self.close(&mut out);
            self.stop_reason = super::stop_reason(&end);
            self.stop_sequence = end.stop_sequence.filter(|_| self.stop_reason == "stop_sequence");
        }
        Ok(out)
    }

    fn finish(&mut self, usage: &Usage) -> Vec<Json> {
        vec![
            json!({"type": "message_delta", "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}, "usage": super::usage_json(usage)}),
            json!({"type": "message_stop"}),
        ]
    }

    fn frame(&self, chunk: &Json) -> Bytes {
        let kind = chunk.get("type").and_then(Json::as_str).unwrap_or("message");
        Bytes::from(format!("event: {kind}\ndata: {chunk}\n\n"))
    }

    fn end(&self) -> Option<Bytes> {
        None
    }

    fn error(&self, e: &ApiError) -> Json {
        super::error::body(e)
    }
}

/// The content blocks the events describe, as the non-streamed answer carries them (what an
/// SDK's stream accumulation rebuilds).
pub fn assemble(events: &[Json]) -> Vec<Json> {
    let mut blocks: Vec<Json> = Vec::new();
    let mut json_text: Vec<String> = Vec::new();
    for e in events {
        let i = e["index"].as_u64().unwrap_or(0) as usize;
        match e["type"].as_str() {
            Some("content_block_start") => {
                blocks.push(e["content_block"].clone());
                json_text.push(String::new());
            }
            Some("content_block_delta") => {
                let (Some(b), d) = (blocks.get_mut(i), &e["delta"]) else { continue };
                let append = |b: &mut Json, key: &str, more: &Json| {
                    let s = format!("{}{}", b[key].as_str().unwrap_or(""), more.as_str().unwrap_or(""));
                    b[key] = Json::String(s);
                };
                match d["type"].as_str() {
                    Some("thinking_delta") => append(b, "thinking", &d["thinking"]),
                    Some("text_delta") => append(b, "text", &d["text"]),
                    Some("signature_delta") => b["signature"] = d["signature"].clone(),
                    Some("input_json_delta") => json_text[i].push_str(d["partial_json"].as_str().unwrap_or("")),
                    _ => {}
                }
            }
            Some("content_block_stop") if blocks.get(i).is_some_and(|b| b["type"] == "tool_use") => {
                blocks[i]["input"] = super::input_object(&json_text[i]);
            }
            _ => {}
        }
    }
    blocks
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::run::ChoiceEnd;

    fn update(deltas: Vec<Delta>, end: Option<ChoiceEnd>) -> Update {
        Update { slot: 0, index: 0, deltas, logprobs: Vec::new(), end }
    }

    fn types(v: &[Json]) -> Vec<String> {
        v.iter()
            .map(|e| {
                let t = e["type"].as_str().unwrap().to_string();
                match e.get("delta").and_then(|d| d.get("type")) {
                    Some(d) => format!("{t}:{}", d.as_str().unwrap()),
                    None => t,
                }
            })
            .collect()
    }

    /// Blocks open in the order the model writes them, one per kind change and one per tool
    /// call, and each is closed once.
    #[test]
    fn blocks_follow_the_deltas() {
        let mut e = MessageEncoder::new("msg-1".into(), "m".into(), 12);
        let mut all = e.start();
        all.extend(
            e.update(update(
                vec![
                    Delta::Reasoning("Think".into()),
                    Delta::Reasoning("ing.".into()),
                    Delta::Content("Let me ".into()),
                    Delta::Content("check.".into()),
                    Delta::ToolCallStart { index: 0, id: "call_a".into(), name: "get_weather".into() },
                    Delta::ToolCallArguments { index: 0, chunk: "{\"city\": ".into() },
                    Delta::ToolCallArguments { index: 0, chunk: "\"Paris\"}".into() },
                    Delta::ToolCallStart { index: 1, id: "call_b".into(), name: "get_time".into() },
                    Delta::ToolCallArguments { index: 1, chunk: "{}".into() },
                ],
                None,
            ))
            .unwrap(),
        );
        let end = ChoiceEnd { reason: "tool_calls", usage: Usage::default(), chat: None, stop_sequence: None };
        all.extend(e.update(update(vec![], Some(end))).unwrap());
        all.extend(e.finish(&Usage { prompt_tokens: 12, completion_tokens: 9, cached_tokens: 4 }));
        assert_eq!(
            types(&all),
            [
                "message_start", "ping",
                "content_block_start", "content_block_delta:thinking_delta", "content_block_delta:thinking_delta", "content_block_delta:signature_delta", "content_block_stop",
                "content_block_start", "content_block_delta:text_delta", "content_block_delta:text_delta", "content_block_stop",
                "content_block_start", "content_block_delta:input_json_delta", "content_block_delta:input_json_delta", "content_block_stop",
                "content_block_start", "content_block_delta:input_json_delta", "content_block_stop",
                "message_delta", "message_stop",
            ]
        );
        let starts: Vec<&Json> = all.iter().filter(|e| e["type"] == "content_block_start").collect();
        assert_eq!(starts.iter().map(|s| s["index"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert_eq!(starts[2]["content_block"], json!({"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {}}));
        let md = &all[all.len() - 2];
        assert_eq!(md["delta"]["stop_reason"], "tool_use");
        assert_eq!(md["usage"], json!({"input_tokens": 8, "output_tokens": 9, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4}));
        // The blocks the events build: what the non-streamed answer carries.
        let blocks = assemble(&all);
        assert_eq!(blocks[0], json!({"type": "thinking", "thinking": "Thinking.", "signature": signature(fnv(FNV_OFFSET, "Thinking."))}));
        assert_eq!(blocks[1], json!({"type": "text", "text": "Let me check."}));
        assert_eq!(blocks[2], json!({"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {"city": "Paris"}}));
        assert_eq!(blocks[3]["input"], json!({}));
        let f = e.frame(&all[0]);
        assert!(f.starts_with(b"event: message_start\ndata: {") && f.ends_with(b"}\n\n"));
        assert!(e.end().is_none());
    }

    /// Whitespace between blocks opens no text block; before text it is kept.
    #[test]
    fn whitespace_alone_opens_no_text_block() {
        let mut e = MessageEncoder::new("msg-3".into(), "m".into(), 3);
        let mut all = e.update(update(vec![Delta::Reasoning("r".into()), Delta::Content("\n\n".into())], None)).unwrap();
        all.extend(e.update(update(vec![Delta::ToolCallStart { index: 0, id: "c".into(), name: "f".into() }], None)).unwrap());
        all.extend(e.update(update(vec![Delta::ToolCallArguments { index: 0, chunk: "{}".into() }, Delta::Content("\n".into())], None)).unwrap());
        let end = ChoiceEnd { reason: "tool_calls", usage: Usage::default(), chat: None, stop_sequence: Some("x".into()) };
        all.extend(e.update(update(vec![], Some(end))).unwrap());
        assert_eq!(assemble(&all).iter().map(|b| b["type"].as_str().unwrap()).collect::<Vec<_>>(), ["thinking", "tool_use"]);
        // A stop string reported only with the stop_sequence reason.
        assert_eq!(e.finish(&Usage::default())[0]["delta"], json!({"stop_reason": "tool_use", "stop_sequence": null}));
        let mut e = MessageEncoder::new("msg-4".into(), "m".into(), 3);
        let mut all = e.update(update(vec![Delta::Content(" \n".into()), Delta::Content("Hi".into())], None)).unwrap();
        all.extend(e.update(update(vec![], Some(ChoiceEnd { reason: "stop", usage: Usage::default(), chat: None, stop_sequence: None }))).unwrap());
        assert_eq!(assemble(&all), [json!({"type": "text", "text": " \nHi"})]);
    }

    /// The real tool-call parser's events through the encoder: per call, the streamed
    /// `partial_json` pieces are exactly the parser's final arguments, blocks are numbered in
    /// order and each is stopped once.
    #[test]
    fn parser_events_stream_each_calls_final_arguments() {
        use std::sync::Arc;
        use crate::text::format::ModelFormat;
        use crate::text::request::{ToolChoice, parse_tools};
        use crate::text::toolcall::{CallIds, ToolCallParser, ToolEvent};
        let tools = Arc::new(parse_tools(Some(&json!([
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}, "s": {"type": "string"}}, "required": ["x"]}}},
            {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {}}}},
        ]))).unwrap());
        let b = |inner: &str| format!("<minimax:tool_call>\n{inner}</minimax:tool_call>");
        let inv_f = "<invoke name=\"f\">\n<parameter name=\"x\">1</parameter>\n<parameter name=\"s\">a \"q\" \\ b</parameter>\n</invoke>\n";
        let inv_g = "<invoke name=\"g\">\n</invoke>\n";
        let inv_bad = "<invoke name=\"nope\">\n<parameter name=\"y\">[1,2]</parameter>\n</invoke>\n";
        let inv_missing = "<invoke name=\"f\">\n<parameter name=\"s\">no x</parameter>\n</invoke>\n";
        let cases: Vec<(String, bool)> = vec![
            (format!("Before.\n{}\nAfter.", b(&format!("{inv_f}{inv_g}{inv_bad}"))), true),
            (format!("{}\n{}", b(inv_f), b(&format!("{inv_g}{inv_missing}"))), true),
            (format!("{}\n{}", b(inv_f), b(inv_g)), false),
            (format!("Cut {}", &b(inv_f)[..60]), true),
        ];
        for (text, parallel) in cases {
            for step in [1usize, 3, 7, 1000] {
                let mut p = ToolCallParser::new(ModelFormat::minimax_m2().tool_calls, tools.clone(), ToolChoice::Auto, parallel, CallIds::Sequential { prefix: "call_".into(), next: 0 });
                let mut evs = Vec::new();
                let chars: Vec<char> = text.chars().collect();
                for c in chars.chunks(step) {
                    evs.extend(p.push(&c.iter().collect::<String>()));
                }
                evs.extend(p.finish());
                let deltas: Vec<Delta> = evs
                    .into_iter()
                    .map(|e| match e {
                        ToolEvent::Content(c) => Delta::Content(c),
                        ToolEvent::Start { index, id, name } => Delta::ToolCallStart { index, id, name },
                        ToolEvent::Args { index, chunk } => Delta::ToolCallArguments { index, chunk },
                    })
                    .collect();
                let mut e = MessageEncoder::new("m".into(), "m".into(), 1);
                let mut all = e.update(update(deltas, None)).unwrap();
                all.extend(e.update(update(vec![], Some(ChoiceEnd { reason: "tool_calls", usage: Usage::default(), chat: None, stop_sequence: None }))).unwrap());
                let starts: Vec<u64> = all.iter().filter(|v| v["type"] == "content_block_start").map(|v| v["index"].as_u64().unwrap()).collect();
                let stops: Vec<u64> = all.iter().filter(|v| v["type"] == "content_block_stop").map(|v| v["index"].as_u64().unwrap()).collect();
                assert_eq!(starts, (0..starts.len() as u64).collect::<Vec<_>>());
                assert_eq!(starts, stops);
                let blocks = assemble(&all);
                let uses: Vec<&Json> = blocks.iter().filter(|b| b["type"] == "tool_use").collect();
                assert_eq!(uses.len(), p.calls().len(), "{text}");
                for (u, c) in uses.iter().zip(p.calls()) {
                    let bi = blocks.iter().position(|b| std::ptr::eq(b, *u)).unwrap() as u64;
                    let streamed: String = all
                        .iter()
                        .filter(|v| v["type"] == "content_block_delta" && v["index"] == bi)
                        .map(|v| v["delta"]["partial_json"].as_str().unwrap())
                        .collect();
                    assert_eq!(streamed, c.arguments, "{text}");
                    assert_eq!(u["input"], serde_json::from_str::<Json>(&c.arguments).unwrap());
                    assert_eq!((u["id"].as_str(), u["name"].as_str()), (Some(c.id.as_str()), Some(c.name.as_str())));
                }
            }
        }
    }

    #[test]
    fn a_stop_sequence_is_reported() {
        let mut e = MessageEncoder::new("msg-2".into(), "m".into(), 3);
        e.update(update(vec![Delta::Content("alpha ".into())], None)).unwrap();
        let end = ChoiceEnd { reason: "stop", usage: Usage::default(), chat: None, stop_sequence: Some("STOP".into()) };
        let out = e.update(update(vec![], Some(end))).unwrap();
        assert_eq!(types(&out), ["content_block_stop"]);
        let fin = e.finish(&Usage::default());
        assert_eq!(fin[0]["delta"], json!({"stop_reason": "stop_sequence", "stop_sequence": "STOP"}));
    }
}
