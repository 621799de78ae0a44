//! An OpenAI Responses request read into what the chat path runs ([`ChatText`]) and the
//! sampling fields. Responses is the protocol Codex CLI speaks (it no longer speaks chat
//! completions to custom providers).
//!
//! - `instructions` becomes a system message; `input` a user message (a string) or, item by
//!   item: `message` items (roles `user`, `system`, `developer`, `assistant`; `input_text` /
//!   `output_text` parts), `function_call_output` items as `tool` messages; consecutive
//!   `reasoning`, assistant `message` and `function_call` items as one assistant message
//!   (`reasoning_content`, `content`, `tool_calls`), as the model wrote them;
//! - `tools`: `function` tools become chat tools; `custom` (freeform) tools, Codex's
//!   `apply_patch`, become function tools of one string parameter `input` (its grammar in the
//!   parameter's description), and their calls go back as `custom_tool_call` items with the
//!   raw input; `custom_tool_call` / `custom_tool_call_output` input items map back the same
//!   way. Hosted tools (web search, file search, image generation, ...) are left out: nothing
//!   here runs them. `tool_choice` and `parallel_tool_calls` pass through.
//!
//! Nothing is stored: `store` is accepted and has no effect, and `previous_response_id` /
//! `conversation` are refused (send the whole input). Also refused with a 400 naming the
//! field: structured output formats, background runs, image and file inputs in the last item
//! (earlier ones become a placeholder).

use serde_json::{Map, Value as Json, json};

use crate::api::error::ApiError;
use crate::api::format::responses_text_format;
use crate::api::params::{Fields, temperature_top_p_top_k, type_name};
use crate::constrain::schema::Grammar;
use crate::engine::SamplingParams;
use crate::text::request::ChatText;

/// The fields of a Responses request besides the conversation.
#[derive(Debug, Clone)]
pub struct ResponsesParams {
    pub model: Option<String>,
    /// `None`: the rest of the context.
    pub max_output_tokens: Option<u32>,
    pub stream: bool,
    pub sampling: SamplingParams,
    /// Echoed in the response object.
    pub instructions: Option<String>,
    pub tools: Json,
    pub tool_choice: Json,
    pub parallel_tool_calls: bool,
    pub metadata: Json,
    /// Names of the `custom` (freeform) tools: their calls are `custom_tool_call` items.
    pub custom_tools: Vec<String>,
    /// Functions of a namespace tool: (the name the model sees, the namespace, the name).
    pub namespaced: Vec<(String, String, String)>,
    /// `reasoning.summary` was asked for: reasoning items carry the reasoning as their summary
    /// too, streamed as summary text.
    pub summary: bool,
    /// `text.format` as asked (echoed in the response object).
    pub text_format: Json,
    /// A structured output's compiled schema (`text.format` `json_schema` / `json_object`).
    pub format: Option<Grammar>,
}

/// The name the model sees for a namespace's function.
pub fn flat_name(namespace: &str, name: &str) -> String {
    format!("{namespace}__{name}")
}

/// Reads a Responses request.
pub fn read(obj: &Map<String, Json>, defaults: &SamplingParams) -> Result<(ChatText, ResponsesParams), ApiError> {
    let mut f = Fields::new(obj);
    let model = f.string("model")?.map(str::to_string);
    let max_output_tokens = f.integer("max_output_tokens", 1, u32::MAX as i64)?.map(|m| m as u32);
    let stream = f.bool("stream")?.unwrap_or(false);
    let mut sampling = defaults.clone();
    temperature_top_p_top_k(&mut f, &mut sampling, 2.0)?;
    if let Some(seed) = f.integer("seed", i64::MIN, i64::MAX)? {
        sampling.seed = Some(seed as u64);
    }
    for (key, why) in [
        ("previous_response_id", "responses are not stored; send the whole conversation in `input`"),
        ("conversation", "conversations are not stored; send the whole conversation in `input`"),
        ("prompt", "stored prompts are not supported"),
    ] {
        if f.get(key).is_some() {
            return Err(ApiError::unsupported(key, why));
        }
    }
    if f.bool("background")? == Some(true) {
        return Err(ApiError::unsupported("background", "background responses are not supported"));
    }
    let (text_format, format) = match f.get("text") {
        None => (json!({"type": "text"}), None),
        Some(Json::Object(t)) => {
            let fmt = t.get("format");
            (fmt.cloned().filter(|v| !v.is_null()).unwrap_or_else(|| json!({"type": "text"})), responses_text_format(fmt)?)
        }
        Some(v) => return Err(ApiError::invalid("text", format!("must be an object, got {}", type_name(v)))),
    };
    // The model always reasons (`effort` has no effect). Asked for a summary, the reasoning is
    // streamed as the summary too: there is no separate summarizer, and clients (Codex) show
    // summaries by default, raw reasoning only when asked.
    let summary = match f.get("reasoning") {
        None => false,
        Some(Json::Object(r)) => ["summary", "generate_summary"].iter().any(|k| r.get(*k).and_then(Json::as_str).is_some_and(|v| v != "none")),
        Some(v) => return Err(ApiError::invalid("reasoning", format!("must be an object, got {}", type_name(v)))),
    };
    // Accepted and ignored: they do not change the output.
    for k in ["store", "include", "user", "safety_identifier", "service_tier", "prompt_cache_key", "prompt_cache_retention", "truncation", "stream_options", "top_logprobs", "max_tool_calls"] {
        let _ = f.get(k);
    }
    let metadata = f.get("metadata").cloned().unwrap_or(Json::Null);
    let instructions = match f.get("instructions") {
        None => None,
        Some(Json::String(s)) => Some(s.clone()),
        Some(v) => return Err(ApiError::invalid("instructions", format!("must be a string, got {}", type_name(v)))),
    };
    let mut messages = Vec::new();
    if let Some(i) = &instructions {
        messages.push(json!({"role": "system", "content": i}));
    }
    match f.get("input") {
        Some(Json::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Json::Array(items)) => {
            if items.is_empty() {
                return Err(ApiError::invalid("input", "must hold at least one item"));
            }
            Items::default().read(items, &mut messages)?;
        }
        Some(v) => return Err(ApiError::invalid("input", format!("must be a string or an array of items, got {}", type_name(v)))),
        None => return Err(ApiError::invalid("input", "is required")),
    }
    let tools_in = match f.get("tools") {
        None => Vec::new(),
        Some(Json::Array(a)) => a.clone(),
        Some(v) => return Err(ApiError::invalid("tools", format!("must be an array, got {}", type_name(v)))),
    };
    let mut tools = Vec::new();
    let mut custom_tools = Vec::new();
    let mut namespaced = Vec::new();
    for (i, t) in tools_in.iter().enumerate() {
        let at = format!("tools[{i}]");
        // A namespace (Codex's MCP servers) lends its name to its functions: `ns__name`.
        let (ns, inner): (Option<&str>, Vec<(String, &Json)>) = if t.get("type").and_then(Json::as_str) == Some("namespace") {
            let ns = t.get("name").and_then(Json::as_str).ok_or_else(|| ApiError::invalid(format!("{at}.name"), "is required"))?;
            let list = t.get("tools").and_then(Json::as_array).ok_or_else(|| ApiError::invalid(format!("{at}.tools"), "must be an array"))?;
            (Some(ns), list.iter().enumerate().map(|(j, x)| (format!("{at}.tools[{j}]"), x)).collect())
        } else {
            (None, vec![(at, t)])
        };
        for (at, t) in inner {
            match tool(t, &at, ns)? {
                Tool::Function(f) => tools.push(f),
                Tool::Custom(f, name) => {
                    tools.push(f);
                    custom_tools.push(name);
                }
                Tool::Hosted(kind) => tracing::debug!(kind, "responses: leaving out a hosted tool nothing here runs"),
            }
            if let (Some(ns), Some(name)) = (ns, t.get("name").and_then(Json::as_str)) {
                namespaced.push((flat_name(ns, name), ns.to_string(), name.to_string()));
            }
        }
    }
    let tool_choice = match f.get("tool_choice") {
        None => json!("auto"),
        Some(Json::String(s)) if ["auto", "none", "required"].contains(&s.as_str()) => json!(s),
        Some(Json::Object(o)) if matches!(o.get("type").and_then(Json::as_str), Some("function" | "custom")) => match o.get("name") {
            Some(Json::String(n)) => json!({"type": "function", "name": n}),
            _ => return Err(ApiError::invalid("tool_choice.name", "is required")),
        },
        Some(v) => return Err(ApiError::unsupported("tool_choice", format!("must be `auto`, `none`, `required` or a function, got {v}"))),
    };
    let parallel_tool_calls = f.bool("parallel_tool_calls")?.unwrap_or(true);
    let unknown = f.unknown();
    if !unknown.is_empty() {
        tracing::debug!(fields = ?unknown, "responses: ignoring unknown request fields");
    }
    let chat_choice = match &tool_choice {
        Json::Object(o) => json!({"type": "function", "function": {"name": o["name"]}}),
        c => c.clone(),
    };
    let chat = ChatText {
        messages,
        tool_choice: (!tools.is_empty()).then_some(chat_choice),
        tools: (!tools.is_empty()).then(|| Json::Array(tools)),
        parallel_tool_calls: Some(parallel_tool_calls),
        chat_template_kwargs: None,
        reasoning_format: Some("parsed".into()),
    };
    let params = ResponsesParams { model, max_output_tokens, stream, sampling, instructions, tools: Json::Array(tools_in), tool_choice, parallel_tool_calls, metadata, custom_tools, namespaced, summary, text_format, format };
    Ok((chat, params))
}

/// The assistant message being built from consecutive output items.
#[derive(Default)]
struct Items {
    reasoning: Vec<String>,
    content: Vec<String>,
    calls: Vec<Json>,
}

impl Items {
    fn flush(&mut self, out: &mut Vec<Json>) {
        if self.reasoning.is_empty() && self.content.is_empty() && self.calls.is_empty() {
            return;
        }
        let mut m = json!({"role": "assistant", "content": self.content.join("\n\n")});
        if !self.reasoning.is_empty() {
            m["reasoning_content"] = Json::String(self.reasoning.join("\n"));
        }
        if !self.calls.is_empty() {
            m["tool_calls"] = Json::Array(std::mem::take(&mut self.calls));
        }
        self.reasoning.clear();
        self.content.clear();
        out.push(m);
    }

    fn read(mut self, items: &[Json], out: &mut Vec<Json>) -> Result<(), ApiError> {
        for (i, item) in items.iter().enumerate() {
            let at = format!("input[{i}]");
            let last = i + 1 == items.len();
            let Json::Object(o) = item else {
                return Err(ApiError::invalid(&at, format!("must be an object, got {}", type_name(item))));
            };
            // `type` may be left out of a message item (`{"role": .., "content": ..}`).
            let kind = match o.get("type") {
                Some(Json::String(t)) => t.as_str(),
                None if o.contains_key("role") => "message",
                Some(v) => return Err(ApiError::invalid(format!("{at}.type"), format!("must be a string, got {}", type_name(v)))),
                None => return Err(ApiError::invalid(format!("{at}.type"), "is required")),
            };
            match kind {
                "message" => {
                    let role = match o.get("role").and_then(Json::as_str) {
                        Some(r @ ("user" | "system" | "developer" | "assistant")) => r,
                        Some(r) => return Err(ApiError::invalid(format!("{at}.role"), format!("must be `user`, `system`, `developer` or `assistant`, got `{r}`"))),
                        None => return Err(ApiError::invalid(format!("{at}.role"), "is required")),
                    };
                    let text = content_text(o.get("content"), &format!("{at}.content"), last && role == "user")?;
                    match role {
                        "assistant" => self.content.push(text),
                        "user" => {
                            self.flush(out);
                            out.push(json!({"role": "user", "content": text}));
                        }
                        // The template takes one system message, first: `instructions` and the
                        // leading system / developer items (Codex's permissions) make it; a later
                        // one (settings changed mid-session) is a labelled user message there.
                        _ if out.iter().all(|m| m["role"] == "system") => match out.first_mut() {
                            Some(sys) => sys["content"] = json!(format!("{}\n\n{text}", sys["content"].as_str().unwrap_or(""))),
                            None => out.push(json!({"role": "system", "content": text})),
                        },
                        _ => {
                            self.flush(out);
                            out.push(json!({"role": "user", "content": format!("[{role} message]\n{text}")}));
                        }
                    }
                }
                "reasoning" => {
                    // The raw reasoning (`content`), else its summary.
                    let parts = o.get("content").filter(|c| c.as_array().is_some_and(|a| !a.is_empty())).or_else(|| o.get("summary"));
                    let text = match parts {
                        None | Some(Json::Null) => String::new(),
                        Some(Json::Array(a)) => a.iter().filter_map(|p| p.get("text").and_then(Json::as_str)).collect::<Vec<_>>().join("\n"),
                        Some(v) => return Err(ApiError::invalid(format!("{at}.content"), format!("must be an array, got {}", type_name(v)))),
                    };
                    if !text.is_empty() {
                        self.reasoning.push(text);
                    }
                }
                "function_call" => {
                    let call_id = string_field(item, "call_id", &at)?;
                    let mut name = string_field(item, "name", &at)?;
                    if let Some(ns) = o.get("namespace").and_then(Json::as_str) {
                        name = flat_name(ns, &name);
                    }
                    let arguments = string_field(item, "arguments", &at)?;
                    self.calls.push(json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}));
                }
                "custom_tool_call" => {
                    let call_id = string_field(item, "call_id", &at)?;
                    let name = string_field(item, "name", &at)?;
                    let input = string_field(item, "input", &at)?;
                    let arguments = json!({"input": input}).to_string();
                    self.calls.push(json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}));
                }
                "function_call_output" | "custom_tool_call_output" => {
                    self.flush(out);
                    let call_id = string_field(item, "call_id", &at)?;
                    let output = match o.get("output") {
                        Some(Json::String(s)) => s.clone(),
                        v @ Some(Json::Array(_)) => content_text(v, &format!("{at}.output"), false)?,
                        Some(v) => return Err(ApiError::invalid(format!("{at}.output"), format!("must be a string or an array of parts, got {}", type_name(v)))),
                        None => return Err(ApiError::invalid(format!("{at}.output"), "is required")),
                    };
                    out.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
                }
                t => return Err(ApiError::unsupported(format!("{at}.type"), format!("`{t}` items are not supported"))),
            }
        }
        self.flush(out);
        if out.last().and_then(|m| m.get("role")).and_then(Json::as_str) == Some("assistant") {
            return Err(ApiError::unsupported("input", "the input ends with the assistant's output; end with a user message or a function call output"));
        }
        Ok(())
    }
}

fn string_field(v: &Json, key: &str, at: &str) -> Result<String, ApiError> {
    match v.get(key) {
        Some(Json::String(s)) => Ok(s.clone()),
        Some(x) => Err(ApiError::invalid(format!("{at}.{key}"), format!("must be a string, got {}", type_name(x)))),
        None => Err(ApiError::invalid(format!("{at}.{key}"), "is required")),
    }
}

/// A message's content (a string or text parts) as text; with `strict`, an image or file part
/// is refused (the item being answered), else it stands as a placeholder.
fn content_text(v: Option<&Json>, at: &str, strict: bool) -> Result<String, ApiError> {
    match v {
        Some(Json::String(s)) => Ok(s.clone()),
        Some(Json::Array(parts)) => {
            let mut out = Vec::new();
            for (j, p) in parts.iter().enumerate() {
                let pat = format!("{at}[{j}]");
                match p.get("type").and_then(Json::as_str) {
                    Some("input_text" | "output_text" | "text" | "summary_text" | "reasoning_text") => out.push(string_field(p, "text", &pat)?),
                    Some("refusal") => out.push(string_field(p, "refusal", &pat)?),
                    Some(t @ ("input_image" | "input_file" | "input_audio")) if !strict => out.push(format!("[{} omitted: this model reads text only]", &t[6..])),
                    Some(t @ ("input_image" | "input_file" | "input_audio")) => {
                        return Err(ApiError::unsupported(format!("{pat}.type"), format!("`{t}` parts are not supported: the model reads text only")));
                    }
                    Some(t) => return Err(ApiError::invalid(format!("{pat}.type"), format!("unknown content part type `{t}`"))),
                    None => return Err(ApiError::invalid(format!("{pat}.type"), "is required")),
                }
            }
            Ok(out.join("\n"))
        }
        None | Some(Json::Null) => Err(ApiError::invalid(at, "is required")),
        Some(v) => Err(ApiError::invalid(at, format!("must be a string or an array of parts, got {}", type_name(v)))),
    }
}

/// A request tool as the chat path takes it.
enum Tool {
    Function(Json),
    /// A freeform tool as a function of one string `input`, and its name.
    Custom(Json, String),
    /// A tool the provider runs (its type): left out.
    Hosted(String),
}

fn tool(t: &Json, at: &str, namespace: Option<&str>) -> Result<Tool, ApiError> {
    let kind = match t.get("type").and_then(Json::as_str) {
        Some(k) => k,
        None => return Err(ApiError::invalid(format!("{at}.type"), "is required")),
    };
    if kind != "function" && kind != "custom" {
        return Ok(Tool::Hosted(kind.to_string()));
    }
    let mut name = string_field(t, "name", at)?;
    if let Some(ns) = namespace {
        name = flat_name(ns, &name);
    }
    let parameters = if kind == "custom" {
        let mut about = "The tool's input as raw text, exactly as the tool description asks (not JSON).".to_string();
        if let Some(f) = t.get("format").filter(|f| f.get("type").and_then(Json::as_str) == Some("grammar")) {
            let syntax = f.get("syntax").and_then(Json::as_str).unwrap_or("lark");
            let definition = f.get("definition").and_then(Json::as_str).unwrap_or("");
            about.push_str(&format!(" It follows this {syntax} grammar:\n{definition}"));
        }
        json!({"type": "object", "properties": {"input": {"type": "string", "description": about}}, "required": ["input"]})
    } else {
        t.get("parameters").cloned().filter(|p| !p.is_null()).unwrap_or_else(|| json!({"type": "object", "properties": {}}))
    };
    let mut function = json!({"name": name, "parameters": parameters});
    if let Some(d) = t.get("description").and_then(Json::as_str) {
        function["description"] = json!(d);
    }
    let f = json!({"type": "function", "function": function});
    Ok(if kind == "custom" { Tool::Custom(f, name) } else { Tool::Function(f) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_json(v: Json) -> Result<(ChatText, ResponsesParams), ApiError> {
        read(v.as_object().unwrap(), &SamplingParams::default())
    }

    /// A Codex-like turn: instructions, the user's message, the model's reasoning, a call and
    /// its output, then the next user message.
    #[test]
    fn items_become_chat_messages() {
        let (chat, p) = read_json(json!({
            "model": "m", "instructions": "You are a coding agent.", "max_output_tokens": 100, "stream": true, "store": false,
            "reasoning": {"effort": "high"}, "include": ["reasoning.encrypted_content"],
            "tools": [{"type": "function", "name": "shell", "description": "Run", "parameters": {"type": "object", "properties": {"command": {"type": "array"}}}, "strict": false}],
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be careful."}]},
                {"role": "user", "content": "List files"},
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Use ls."}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Listing."}]},
                {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": "{\"command\":[\"ls\"]}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
                {"type": "message", "role": "developer", "content": "Sandbox changed."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks"}]},
            ]
        }))
        .unwrap();
        assert_eq!((p.max_output_tokens, p.stream, p.parallel_tool_calls), (Some(100), true, true));
        chat.validate().expect("a conversation the chat path takes");
        let m = &chat.messages;
        // One system message: the instructions and the leading developer item.
        assert_eq!(m[0], json!({"role": "system", "content": "You are a coding agent.\n\nBe careful."}));
        assert_eq!(m[1], json!({"role": "user", "content": "List files"}));
        assert_eq!(m[2]["reasoning_content"], "Use ls.");
        assert_eq!(m[2]["content"], "Listing.");
        assert_eq!(m[2]["tool_calls"][0], json!({"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": "{\"command\":[\"ls\"]}"}}));
        assert_eq!(m[3], json!({"role": "tool", "tool_call_id": "call_1", "content": "a.txt"}));
        // A developer item after the conversation started is a labelled user message.
        assert_eq!(m[4], json!({"role": "user", "content": "[developer message]\nSandbox changed."}));
        assert_eq!(m[5], json!({"role": "user", "content": "Thanks"}));
        assert_eq!(m.len(), 6);
        assert_eq!(chat.tools.unwrap()[0]["function"]["name"], "shell");
        assert_eq!(chat.tool_choice, Some(json!("auto")));
    }

    /// Codex's freeform `apply_patch`: a function of one string `input` carrying the grammar;
    /// its calls and outputs in later input map back; hosted tools are left out.
    #[test]
    fn custom_tools_become_one_string_functions() {
        let (chat, p) = read_json(json!({
            "input": [
                {"role": "user", "content": "Add a file"},
                {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch\n*** End Patch\n"},
                {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done"},
            ],
            "tools": [
                {"type": "custom", "name": "apply_patch", "description": "Edit files", "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch"}},
                {"type": "web_search"},
            ],
        }))
        .unwrap();
        assert_eq!(p.custom_tools, ["apply_patch"]);
        chat.validate().expect("a conversation the chat path takes");
        let tools = chat.tools.unwrap();
        assert_eq!(tools.as_array().unwrap().len(), 1);
        let input = &tools[0]["function"]["parameters"]["properties"]["input"];
        assert_eq!(input["type"], "string");
        assert!(input["description"].as_str().unwrap().ends_with("lark grammar:\nstart: begin_patch hunk+ end_patch"));
        let args: Json = serde_json::from_str(chat.messages[1]["tool_calls"][0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"input": "*** Begin Patch\n*** End Patch\n"}));
        assert_eq!(chat.messages[2], json!({"role": "tool", "tool_call_id": "c1", "content": "Done"}));
    }

    /// Codex's MCP tools: a namespace's functions under `ns__name`, and back from history.
    #[test]
    fn namespace_functions_are_flattened() {
        let (chat, p) = read_json(json!({
            "input": [
                {"role": "user", "content": "Search docs"},
                {"type": "function_call", "call_id": "c1", "namespace": "mcp__docs", "name": "search", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "found"},
            ],
            "tools": [{"type": "namespace", "name": "mcp__docs", "description": "Docs server", "tools": [
                {"type": "function", "name": "search", "parameters": {"type": "object", "properties": {}}}]}],
        }))
        .unwrap();
        chat.validate().expect("valid");
        assert_eq!(chat.tools.unwrap()[0]["function"]["name"], "mcp__docs__search");
        assert_eq!(chat.messages[1]["tool_calls"][0]["function"]["name"], "mcp__docs__search");
        assert_eq!(p.namespaced, [("mcp__docs__search".to_string(), "mcp__docs".to_string(), "search".to_string())]);
    }

    #[test]
    fn bad_requests_name_the_field() {
        let base = || json!({"model": "m", "input": "hi"});
        let err = |v: Json| read_json(v).unwrap_err();
        let mut v = base();
        v["previous_response_id"] = json!("resp_1");
        assert_eq!(err(v).param.as_deref(), Some("previous_response_id"));
        let mut v = base();
        v["tools"] = json!([{"type": "function"}]);
        assert_eq!(err(v).param.as_deref(), Some("tools[0].name"));
        let mut v = base();
        v["text"] = json!({"format": {"type": "json_schema", "schema": {"anyOf": []}}});
        assert_eq!(err(v).param.as_deref(), Some("text.format.schema.anyOf"));
        let mut v = base();
        v["input"] = json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]);
        assert_eq!(err(v).param.as_deref(), Some("input[0].content[0].type"));
        let mut v = base();
        v["input"] = json!([{"type": "function_call", "call_id": "c", "name": "f"}]);
        assert_eq!(err(v).param.as_deref(), Some("input[0].arguments"));
        let mut v = base();
        v["input"] = json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]);
        assert_eq!(err(v).param.as_deref(), Some("input"));
        let mut v = base();
        v["input"] = json!([{"type": "item_reference", "id": "x"}]);
        assert_eq!(err(v).param.as_deref(), Some("input[0].type"));
        // An image in an earlier item is a placeholder.
        let mut v = base();
        v["input"] = json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}, {"role": "user", "content": "and?"}]);
        assert_eq!(read_json(v).unwrap().0.messages[0]["content"], "[image omitted: this model reads text only]");
    }
}
