//! An Anthropic Messages request read into what the chat path runs: the conversation as the
//! OpenAI-style messages the chat template takes ([`ChatText`]), and the sampling fields.
//!
//! - `system` (a string or text blocks) becomes a system message;
//! - a user turn's `tool_result` blocks become `tool` messages (first, so they follow the
//!   assistant turn that called them) and its `text` blocks one user message;
//! - an assistant turn's `thinking` blocks become `reasoning_content` (MiniMax-M2 wants its
//!   earlier reasoning back), `text` blocks `content`, `tool_use` blocks `tool_calls` (the
//!   input object as JSON text); `redacted_thinking` is dropped;
//! - `tools` (custom tools: `name`, `description`, `input_schema`) become function tools, and
//!   `tool_choice` `auto` / `any` / `tool` / `none` become `auto` / `required` / a named
//!   function / `none` (`disable_parallel_tool_use` is `parallel_tool_calls: false`).
//!
//! Refused with a 400 naming the field: images and documents in the last turn (the model
//! reads text only; earlier ones, and those in tool results, become a placeholder), server
//! tools (`type` other than `custom`), a last message from the assistant (prefill), structured
//! outputs, and wrong types anywhere.

use serde_json::{Map, Value as Json, json};

use crate::api::error::ApiError;
use crate::api::format::anthropic_output_format;
use crate::api::params::{Fields, string_array, temperature_top_p_top_k, type_name};
use crate::constrain::schema::Grammar;
use crate::engine::SamplingParams;
use crate::text::request::ChatText;

/// The fields of a Messages request besides the conversation.
#[derive(Debug, Clone)]
pub struct MessagesParams {
    pub model: Option<String>,
    pub max_tokens: u32,
    pub stream: bool,
    pub stop_sequences: Vec<String>,
    pub sampling: SamplingParams,
    /// A structured output's compiled schema (`output_config.format`, or the older top-level
    /// `output_format`).
    pub format: Option<Grammar>,
}

/// Most stop sequences a request may give.
pub const MAX_STOP_SEQUENCES: usize = 16;

/// Reads a Messages request: the conversation and tools as the chat path takes them, and the
/// rest. `count_only`: `/v1/messages/count_tokens` (no `max_tokens`, no sampling).
pub fn read(obj: &Map<String, Json>, defaults: &SamplingParams, count_only: bool) -> Result<(ChatText, MessagesParams), ApiError> {
    let mut f = Fields::new(obj);
    let model = f.string("model")?.map(str::to_string);
    let max_tokens = match f.integer("max_tokens", 1, u32::MAX as i64)? {
        Some(m) => m as u32,
        None if count_only => 1,
        None => return Err(ApiError::invalid("max_tokens", "is required")),
    };
    let stream = f.bool("stream")?.unwrap_or(false);
    let stop_sequences = match f.get("stop_sequences") {
        None => Vec::new(),
        Some(Json::Array(a)) => string_array("stop_sequences", a, MAX_STOP_SEQUENCES)?,
        Some(v) => return Err(ApiError::invalid("stop_sequences", format!("must be an array of strings, got {}", type_name(v)))),
    };
    let mut sampling = defaults.clone();
    temperature_top_p_top_k(&mut f, &mut sampling, 1.0)?;
    // MiniMax-M2 always reasons; `thinking` is checked and otherwise has no effect.
    match f.get("thinking") {
        None => {}
        Some(Json::Object(t)) => match t.get("type").and_then(Json::as_str) {
            Some("enabled" | "disabled" | "adaptive" | "between_tools") => {}
            Some(x) => {
                return Err(ApiError::invalid("thinking.type", format!("must be `enabled`, `disabled`, `adaptive` or `between_tools`, got `{x}`")));
            }
            None => return Err(ApiError::invalid("thinking.type", "is required")),
        },
        Some(v) => return Err(ApiError::invalid("thinking", format!("must be an object, got {}", type_name(v)))),
    }
    // `effort` has no counterpart here.
    let mut format = match f.get("output_config") {
        None => None,
        Some(Json::Object(o)) => anthropic_output_format(o.get("format"), "output_config.format")?,
        Some(v) => return Err(ApiError::invalid("output_config", format!("must be an object, got {}", type_name(v)))),
    };
    if let Some(g) = anthropic_output_format(f.get("output_format"), "output_format")? {
        if format.is_some() {
            return Err(ApiError::invalid("output_format", "give the format once, in `output_config.format`"));
        }
        format = Some(g);
    }
    for (key, why) in [("mcp_servers", "MCP servers are not supported"), ("container", "containers are not supported")] {
        if f.get(key).is_some() {
            return Err(ApiError::unsupported(key, why));
        }
    }
    // Accepted and ignored: they do not change the output (prompt caching is automatic here;
    // `context_management`, which Claude Code sends, only clears context the client resends).
    for k in [
        "metadata",
        "service_tier",
        "cache_control",
        "context_management",
        "diagnostics",
        "inference_geo",
        "speed",
        "user_profile_id",
        "workspace_id",
    ] {
        let _ = f.get(k);
    }
    let mut messages = Vec::new();
    if let Some(sys) = f.get("system") {
        let text = match sys {
            Json::String(s) => s.clone(),
            Json::Array(blocks) => texts(blocks, "system", false)?,
            v => return Err(ApiError::invalid("system", format!("must be a string or an array of text blocks, got {}", type_name(v)))),
        };
        messages.push(json!({"role": "system", "content": text}));
    }
    let turns = match f.get("messages") {
        Some(Json::Array(a)) => a,
        Some(v) => return Err(ApiError::invalid("messages", format!("must be an array, got {}", type_name(v)))),
        None => return Err(ApiError::invalid("messages", "is required")),
    };
    if turns.is_empty() {
        return Err(ApiError::invalid("messages", "must hold at least one message"));
    }
    for (i, turn) in turns.iter().enumerate() {
        turn_messages(turn, i, i + 1 == turns.len(), &mut messages)?;
    }
    if turns.last().and_then(|t| t.get("role")).and_then(Json::as_str) == Some("assistant") {
        return Err(ApiError::unsupported(
            format!("messages[{}]", turns.len() - 1),
            "a final assistant message (prefill) is not supported; end with a user message",
        ));
    }
    let tools = match f.get("tools") {
        None => None,
        Some(Json::Array(a)) => Some(Json::Array(a.iter().enumerate().map(|(i, t)| tool(t, i)).collect::<Result<_, _>>()?)),
        Some(v) => return Err(ApiError::invalid("tools", format!("must be an array, got {}", type_name(v)))),
    };
    let (tool_choice, parallel_tool_calls) = match f.get("tool_choice") {
        None => (None, None),
        Some(v) => tool_choice(v)?,
    };
    let unknown = f.unknown();
    if !unknown.is_empty() {
        tracing::debug!(fields = ?unknown, "messages: ignoring unknown request fields");
    }
    // Reasoning always split out: it is the answer's thinking block, whatever the server default.
    let chat = ChatText { messages, tools, tool_choice, parallel_tool_calls, chat_template_kwargs: None, reasoning_format: Some("parsed".into()) };
    Ok((chat, MessagesParams { model, max_tokens, stream, stop_sequences, sampling, format }))
}

/// An error the chat path raised about a tool, with the field named as the Anthropic request
/// has it (`tools[0].input_schema`, not `tools[0].function.parameters`).
pub fn anthropic_names(mut e: ApiError) -> ApiError {
    let rename = |s: &str| s.replace(".function.parameters", ".input_schema").replace(".function.", ".");
    if let Some(p) = &e.param
        && p.starts_with("tools[")
    {
        e.message = rename(&e.message);
        e.param = Some(rename(p));
    }
    e
}

/// The text of an array of `text` blocks (joined by newlines); with `placeholders`, an image or
/// document block stands as a note that it was left out (a tool's output, earlier turns).
fn texts(blocks: &[Json], at: &str, placeholders: bool) -> Result<String, ApiError> {
    let mut out = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        let p = format!("{at}[{i}]");
        match block_type(b, &p)? {
            "text" => out.push(text_of(b, &p)?),
            t @ ("image" | "document") if placeholders => out.push(placeholder(t)),
            t => return Err(ApiError::invalid(format!("{p}.type"), format!("must be `text` here, got `{t}`"))),
        }
    }
    Ok(out.join("\n"))
}

/// What stands in the prompt for an image or document the model cannot read.
fn placeholder(kind: &str) -> String {
    format!("[{kind} omitted: this model reads text only]")
}

fn block_type<'a>(b: &'a Json, at: &str) -> Result<&'a str, ApiError> {
    match b {
        Json::Object(o) => match o.get("type") {
            Some(Json::String(t)) => Ok(t),
            Some(v) => Err(ApiError::invalid(format!("{at}.type"), format!("must be a string, got {}", type_name(v)))),
            None => Err(ApiError::invalid(format!("{at}.type"), "is required")),
        },
        v => Err(ApiError::invalid(at, format!("must be a content block object, got {}", type_name(v)))),
    }
}

fn text_of(b: &Json, at: &str) -> Result<String, ApiError> {
    match b.get("text") {
        Some(Json::String(s)) => Ok(s.clone()),
        Some(v) => Err(ApiError::invalid(format!("{at}.text"), format!("must be a string, got {}", type_name(v)))),
        None => Err(ApiError::invalid(format!("{at}.text"), "is required")),
    }
}

fn string_field(b: &Json, key: &str, at: &str) -> Result<String, ApiError> {
    match b.get(key) {
        Some(Json::String(s)) => Ok(s.clone()),
        Some(v) => Err(ApiError::invalid(format!("{at}.{key}"), format!("must be a string, got {}", type_name(v)))),
        None => Err(ApiError::invalid(format!("{at}.{key}"), "is required")),
    }
}

fn unsupported_block(t: &str, at: &str) -> ApiError {
    let why = match t {
        "image" | "document" => format!("`{t}` blocks are not supported: the model reads text only"),
        _ => format!("`{t}` blocks are not supported here"),
    };
    ApiError::unsupported(format!("{at}.type"), why)
}

/// One Anthropic turn as chat messages, appended to `out`. `last`: the turn being answered
/// (an image or document there is refused; in earlier turns, which a client resends every time,
/// it becomes a placeholder, so one pasted screenshot does not fail the rest of a session).
fn turn_messages(turn: &Json, i: usize, last: bool, out: &mut Vec<Json>) -> Result<(), ApiError> {
    let at = format!("messages[{i}]");
    let Json::Object(o) = turn else {
        return Err(ApiError::invalid(&at, format!("must be an object, got {}", type_name(turn))));
    };
    let role = match o.get("role") {
        Some(Json::String(r)) if r == "user" || r == "assistant" => r.as_str(),
        Some(Json::String(r)) => return Err(ApiError::invalid(format!("{at}.role"), format!("must be `user` or `assistant`, got `{r}`"))),
        Some(v) => return Err(ApiError::invalid(format!("{at}.role"), format!("must be a string, got {}", type_name(v)))),
        None => return Err(ApiError::invalid(format!("{at}.role"), "is required")),
    };
    let blocks = match o.get("content") {
        Some(Json::String(s)) if role == "assistant" => {
            push_assistant(out, json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Json::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Json::Array(a)) => a,
        Some(v) => return Err(ApiError::invalid(format!("{at}.content"), format!("must be a string or an array of blocks, got {}", type_name(v)))),
        None => return Err(ApiError::invalid(format!("{at}.content"), "is required")),
    };
    if role == "assistant" {
        push_assistant(out, assistant_message(blocks, &at)?);
        return Ok(());
    }
    // A user turn: its tool results first (they answer the assistant turn before; Anthropic
    // asks clients to put them first), then its text merged into one user message.
    let mut text: Vec<String> = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let p = format!("{at}.content[{j}]");
        match block_type(b, &p)? {
            "text" => text.push(text_of(b, &p)?),
            "tool_result" => {
                let id = string_field(b, "tool_use_id", &p)?;
                let mut content = match b.get("content") {
                    None | Some(Json::Null) => String::new(),
                    Some(Json::String(s)) => s.clone(),
                    Some(Json::Array(a)) => texts(a, &format!("{p}.content"), true)?,
                    Some(v) => {
                        return Err(ApiError::invalid(format!("{p}.content"), format!("must be a string or an array of text blocks, got {}", type_name(v))));
                    }
                };
                if b.get("is_error").and_then(Json::as_bool) == Some(true) {
                    content = format!("Error: {content}");
                }
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            t @ ("image" | "document") if !last => text.push(placeholder(t)),
            t => return Err(unsupported_block(t, &p)),
        }
    }
    if !text.is_empty() {
        out.push(json!({"role": "user", "content": text.join("\n")}));
    }
    Ok(())
}

/// Appends an assistant message; consecutive assistant turns are one turn (Anthropic combines
/// consecutive turns of a role), so their tool calls answer the tool results that follow.
fn push_assistant(out: &mut Vec<Json>, m: Json) {
    let Some(prev) = out.last_mut().filter(|p| p["role"] == "assistant") else {
        out.push(m);
        return;
    };
    let content = format!("{}{}", prev["content"].as_str().unwrap_or(""), m["content"].as_str().unwrap_or(""));
    prev["content"] = Json::String(content);
    if let Some(r) = m.get("reasoning_content").and_then(Json::as_str) {
        let joined = match prev.get("reasoning_content").and_then(Json::as_str) {
            Some(p) => format!("{p}\n{r}"),
            None => r.to_string(),
        };
        prev["reasoning_content"] = Json::String(joined);
    }
    if let Some(Json::Array(calls)) = m.get("tool_calls") {
        match prev.get_mut("tool_calls") {
            Some(Json::Array(p)) => p.extend(calls.iter().cloned()),
            _ => prev["tool_calls"] = Json::Array(calls.clone()),
        }
    }
}

fn assistant_message(blocks: &[Json], at: &str) -> Result<Json, ApiError> {
    let (mut text, mut reasoning, mut calls) = (Vec::new(), Vec::new(), Vec::new());
    for (j, b) in blocks.iter().enumerate() {
        let p = format!("{at}.content[{j}]");
        match block_type(b, &p)? {
            "text" => text.push(text_of(b, &p)?),
            "thinking" => reasoning.push(string_field(b, "thinking", &p)?),
            "redacted_thinking" => {}
            "tool_use" => {
                let id = string_field(b, "id", &p)?;
                let name = string_field(b, "name", &p)?;
                let input = match b.get("input") {
                    Some(v @ Json::Object(_)) => v.to_string(),
                    Some(v) => return Err(ApiError::invalid(format!("{p}.input"), format!("must be an object, got {}", type_name(v)))),
                    None => return Err(ApiError::invalid(format!("{p}.input"), "is required")),
                };
                calls.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input}}));
            }
            t => return Err(unsupported_block(t, &p)),
        }
    }
    let mut m = json!({"role": "assistant", "content": text.join("")});
    if !reasoning.is_empty() {
        m["reasoning_content"] = Json::String(reasoning.join("\n"));
    }
    if !calls.is_empty() {
        m["tool_calls"] = Json::Array(calls);
    }
    Ok(m)
}

/// A custom tool as a function tool.
fn tool(t: &Json, i: usize) -> Result<Json, ApiError> {
    let at = format!("tools[{i}]");
    let Json::Object(o) = t else {
        return Err(ApiError::invalid(&at, format!("must be an object, got {}", type_name(t))));
    };
    match o.get("type") {
        None | Some(Json::Null) => {}
        Some(Json::String(s)) if s == "custom" => {}
        Some(Json::String(s)) => return Err(ApiError::unsupported(format!("{at}.type"), format!("server tools (`{s}`) are not supported; define a custom tool"))),
        Some(v) => return Err(ApiError::invalid(format!("{at}.type"), format!("must be a string, got {}", type_name(v)))),
    }
    let name = string_field(t, "name", &at)?;
    let mut function = json!({"name": name});
    match o.get("description") {
        None | Some(Json::Null) => {}
        Some(Json::String(d)) => function["description"] = Json::String(d.clone()),
        Some(v) => return Err(ApiError::invalid(format!("{at}.description"), format!("must be a string, got {}", type_name(v)))),
    }
    match o.get("input_schema") {
        Some(s @ Json::Object(_)) => function["parameters"] = s.clone(),
        Some(v) => return Err(ApiError::invalid(format!("{at}.input_schema"), format!("must be an object, got {}", type_name(v)))),
        None => return Err(ApiError::invalid(format!("{at}.input_schema"), "is required")),
    }
    Ok(json!({"type": "function", "function": function}))
}

/// `tool_choice` as the chat path's, and its `disable_parallel_tool_use`.
fn tool_choice(v: &Json) -> Result<(Option<Json>, Option<bool>), ApiError> {
    let Json::Object(o) = v else {
        return Err(ApiError::invalid("tool_choice", format!("must be an object, got {}", type_name(v))));
    };
    let parallel = match o.get("disable_parallel_tool_use") {
        None | Some(Json::Null) => None,
        Some(Json::Bool(b)) => Some(!b),
        Some(v) => return Err(ApiError::invalid("tool_choice.disable_parallel_tool_use", format!("must be a boolean, got {}", type_name(v)))),
    };
    let choice = match o.get("type").and_then(Json::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            let name = string_field(v, "name", "tool_choice")?;
            json!({"type": "function", "function": {"name": name}})
        }
        Some(t) => return Err(ApiError::invalid("tool_choice.type", format!("must be `auto`, `any`, `tool` or `none`, got `{t}`"))),
        None => return Err(ApiError::invalid("tool_choice.type", "is required")),
    };
    Ok((Some(choice), parallel))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_json(v: Json) -> Result<(ChatText, MessagesParams), ApiError> {
        read(v.as_object().unwrap(), &SamplingParams::default(), false)
    }

    #[test]
    fn a_tool_conversation_becomes_chat_messages_in_order() {
        let (chat, p) = read_json(json!({
            "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
            "stop_sequences": ["END"], "temperature": 0.5, "top_k": 7,
            "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Need the tool.", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "And tomorrow?"}]},
            ]
        }))
        .unwrap();
        assert_eq!((p.max_tokens, p.stream, p.stop_sequences.clone()), (64, false, vec!["END".to_string()]));
        assert_eq!((p.sampling.temperature, p.sampling.top_k), (0.5, 7));
        let m = &chat.messages;
        assert_eq!(m.len(), 5);
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief.\nUse tools."}));
        assert_eq!(m[1], json!({"role": "user", "content": "Weather in Paris?"}));
        assert_eq!(m[2]["reasoning_content"], "Need the tool.");
        assert_eq!(m[2]["content"], "Checking.");
        assert_eq!(m[2]["tool_calls"][0]["function"]["name"], "get_weather");
        let args: Json = serde_json::from_str(m[2]["tool_calls"][0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"city": "Paris"}));
        assert_eq!(m[3], json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"}));
        assert_eq!(m[4], json!({"role": "user", "content": "And tomorrow?"}));
        assert_eq!(chat.tools.as_ref().unwrap()[0]["function"]["parameters"]["properties"]["city"]["type"], "string");
        assert_eq!(chat.tool_choice, Some(json!("required")));
        assert_eq!(chat.parallel_tool_calls, Some(false));
    }

    /// Anthropic combines consecutive turns of one role; a history that sends a parallel call
    /// as two assistant turns (one `tool_use` each) answered by one user turn must be accepted.
    #[test]
    fn consecutive_assistant_turns_with_calls_are_one_turn() {
        let (chat, _) = read_json(json!({
            "model": "m", "max_tokens": 64,
            "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {}}}],
            "messages": [
                {"role": "user", "content": "Do two things."},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_b", "name": "f", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_a", "content": "A"},
                    {"type": "tool_result", "tool_use_id": "toolu_b", "content": "B"}]},
            ]
        }))
        .unwrap();
        let v = chat.validate();
        assert!(v.is_ok(), "a valid Anthropic history is refused: {:?}", v.err());
        assert_eq!(chat.messages[1]["tool_calls"].as_array().map(Vec::len), Some(2));
    }

    #[test]
    fn tool_errors_name_anthropic_fields() {
        let e = anthropic_names(ApiError::invalid("tools[1].function.parameters", "is not a valid JSON schema"));
        assert_eq!((e.param.as_deref(), e.message.as_str()), (Some("tools[1].input_schema"), "tools[1].input_schema: is not a valid JSON schema"));
        let e = anthropic_names(ApiError::invalid("tools[0].function.name", "duplicate"));
        assert_eq!(e.param.as_deref(), Some("tools[0].name"));
        let e = anthropic_names(ApiError::invalid("messages[0].content", "x"));
        assert_eq!(e.param.as_deref(), Some("messages[0].content"));
    }

    #[test]
    fn bad_requests_name_the_field() {
        let base = || json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
        let err = |v: Json| read_json(v).unwrap_err();
        let mut v = base();
        v.as_object_mut().unwrap().remove("max_tokens");
        assert_eq!(err(v).param.as_deref(), Some("max_tokens"));
        let mut v = base();
        v["messages"][0]["content"] = json!([{"type": "image", "source": {}}]);
        let e = err(v);
        assert_eq!((e.param.as_deref(), e.code), (Some("messages[0].content[0].type"), Some("unsupported_value")));
        // In an earlier turn, or a tool's output, an image becomes a placeholder.
        let mut v = base();
        v["messages"] = json!([
            {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image", "source": {}}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "read", "input": {}}]},
            {"role": "user", "content": [{"type": "text", "text": "next"},
                {"type": "tool_result", "tool_use_id": "c1", "is_error": true, "content": [{"type": "image", "source": {}}]}]},
        ]);
        let (chat, _) = read_json(v).unwrap();
        assert_eq!(chat.messages[0]["content"], "look\n[image omitted: this model reads text only]");
        // The tool result comes before the turn's text, whatever the block order.
        assert_eq!(chat.messages[2], json!({"role": "tool", "tool_call_id": "c1", "content": "Error: [image omitted: this model reads text only]"}));
        assert_eq!(chat.messages[3], json!({"role": "user", "content": "next"}));
        let mut v = base();
        v["messages"] = json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": "The answer is"}]);
        assert_eq!(err(v).param.as_deref(), Some("messages[1]"));
        let mut v = base();
        v["tools"] = json!([{"type": "web_search_20250305", "name": "web_search"}]);
        assert_eq!(err(v).param.as_deref(), Some("tools[0].type"));
        let mut v = base();
        v["temperature"] = json!(1.5);
        assert_eq!(err(v).param.as_deref(), Some("temperature"));
        let mut v = base();
        v["messages"][0]["role"] = json!("system");
        assert_eq!(err(v).param.as_deref(), Some("messages[0].role"));
        let mut v = base();
        v["tool_choice"] = json!({"type": "tool"});
        assert_eq!(err(v).param.as_deref(), Some("tool_choice.name"));
        let mut v = base();
        v["messages"] = json!([]);
        assert_eq!(err(v).param.as_deref(), Some("messages"));
        let mut v = base();
        v["output_config"] = json!({"effort": "high", "format": {"type": "xml"}});
        assert_eq!(err(v).param.as_deref(), Some("output_config.format.type"));
        let mut v = base();
        v["output_config"] = json!({"format": {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"if": {}}}}}});
        assert_eq!(err(v).param.as_deref(), Some("output_config.format.schema.properties.a.if"));
        let mut v = base();
        v["thinking"] = json!({"type": "sometimes"});
        assert_eq!(err(v).param.as_deref(), Some("thinking.type"));
        // Newer fields that change nothing here are accepted.
        let mut v = base();
        v["output_config"] = json!({"effort": "low"});
        v["thinking"] = json!({"type": "adaptive"});
        v["cache_control"] = json!({"type": "ephemeral"});
        v["context_management"] = json!({"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]});
        v["speed"] = json!("fast");
        assert!(read_json(v).is_ok());
        // count_tokens needs no max_tokens.
        let mut v = base();
        v.as_object_mut().unwrap().remove("max_tokens");
        assert!(read(v.as_object().unwrap(), &SamplingParams::default(), true).is_ok());
    }
}
