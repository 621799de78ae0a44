//! OpenAI chat messages: validation with precise error paths, then the template's view of them.

use serde_json::{Map, Value as Json};

use super::error::{InvalidRequest, type_name};

/// Who wrote a message; `developer` is accepted and mapped to `System`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// System prompt (only as the first message: the M2 template ignores later ones).
    System,
    /// The user.
    User,
    /// The model, possibly with reasoning and tool calls.
    Assistant,
    /// A tool's result.
    Tool,
}

impl Role {
    /// The role name templates expect.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// Message content: a string or an array of text parts (kept as parts: templates differ in
/// how they join them).
#[derive(Debug, Clone, PartialEq)]
pub enum Content {
    /// Plain text (`null` becomes empty text).
    Text(String),
    /// `[{"type": "text", "text": ...}, ...]`.
    Parts(Vec<String>),
}

impl Content {
    /// The text as one string (parts concatenated), for checks and logs.
    pub fn joined(&self) -> String {
        match self {
            Content::Text(t) => t.clone(),
            Content::Parts(p) => p.concat(),
        }
    }

    fn to_json(&self) -> Json {
        match self {
            Content::Text(t) => Json::String(t.clone()),
            Content::Parts(parts) => Json::Array(
                parts
                    .iter()
                    .map(|t| {
                        let mut m = Map::new();
                        m.insert("type".into(), "text".into());
                        m.insert("text".into(), Json::String(t.clone()));
                        Json::Object(m)
                    })
                    .collect(),
            ),
        }
    }
}

/// A tool call inside an assistant message, with `arguments` parsed into an object.
#[derive(Debug, Clone, PartialEq)]
pub struct HistoryToolCall {
    /// The call id, when the client sent one.
    pub id: Option<String>,
    /// Function name.
    pub name: String,
    /// Arguments as an object (templates iterate them with `| items`).
    pub arguments: Map<String, Json>,
}

/// One validated message.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// Author.
    pub role: Role,
    /// Visible content.
    pub content: Content,
    /// Earlier reasoning sent back by the client (`reasoning_content`, or `reasoning`).
    pub reasoning_content: Option<String>,
    /// Assistant tool calls.
    pub tool_calls: Vec<HistoryToolCall>,
    /// For tool messages: which call this answers.
    pub tool_call_id: Option<String>,
    /// Optional participant or tool name.
    pub name: Option<String>,
    /// Fields this server does not interpret (e.g. `current_date` on the system message),
    /// passed to the template untouched as HF does.
    pub extra: Map<String, Json>,
}

/// Message fields the validator interprets; everything else goes to [`Message::extra`].
const KNOWN_FIELDS: &[&str] = &[
    "role",
    "content",
    "reasoning_content",
    "reasoning",
    "tool_calls",
    "tool_call_id",
    "name",
];

impl Message {
    /// The object the chat template receives, in HF's shape.
    pub fn to_template_json(&self) -> Json {
        let mut m = Map::new();
        m.insert("role".into(), self.role.as_str().into());
        m.insert("content".into(), self.content.to_json());
        if let Some(r) = &self.reasoning_content {
            m.insert("reasoning_content".into(), Json::String(r.clone()));
        }
        if !self.tool_calls.is_empty() {
            let calls = self
                .tool_calls
                .iter()
                .map(|c| {
                    let mut call = Map::new();
                    if let Some(id) = &c.id {
                        call.insert("id".into(), Json::String(id.clone()));
                    }
                    call.insert("type".into(), "function".into());
                    let mut f = Map::new();
                    f.insert("name".into(), Json::String(c.name.clone()));
                    f.insert("arguments".into(), Json::Object(c.arguments.clone()));
                    call.insert("function".into(), Json::Object(f));
                    Json::Object(call)
                })
                .collect();
            m.insert("tool_calls".into(), Json::Array(calls));
        }
        if let Some(id) = &self.tool_call_id {
            m.insert("tool_call_id".into(), Json::String(id.clone()));
        }
        if let Some(n) = &self.name {
            m.insert("name".into(), Json::String(n.clone()));
        }
        for (k, v) in &self.extra {
            m.insert(k.clone(), v.clone());
        }
        Json::Object(m)
    }
}

/// Validates `messages` and converts them; errors name the message index and field.
pub fn parse_messages(values: &[Json]) -> Result<Vec<Message>, InvalidRequest> {
    if values.is_empty() {
        return Err(InvalidRequest::new(
            "messages",
            "must contain at least one message",
        ));
    }
    let mut out: Vec<Message> = Vec::with_capacity(values.len());
    // The last message that is not a tool result (what tool results answer), kept as we go so
    // a long run of tool results is not a scan back each (quadratic).
    let mut caller: Option<usize> = None;
    for (i, v) in values.iter().enumerate() {
        let msg = parse_message(i, v)?;
        check_sequence(i, &msg, caller.map(|c| &out[c]))?;
        if msg.role != Role::Tool {
            caller = Some(out.len());
        }
        out.push(msg);
    }
    Ok(out)
}

fn parse_message(i: usize, v: &Json) -> Result<Message, InvalidRequest> {
    let at = |field: &str| format!("messages[{i}].{field}");
    let obj = v.as_object().ok_or_else(|| {
        InvalidRequest::new(
            format!("messages[{i}]"),
            format!("must be an object, got {}", type_name(v)),
        )
    })?;
    let role = match obj.get("role") {
        Some(Json::String(r)) => match r.as_str() {
            "system" | "developer" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" => Role::Tool,
            other => {
                return Err(InvalidRequest::new(
                    at("role"),
                    format!(
                        "unknown role `{other}`; expected system, developer, user, assistant or tool"
                    ),
                ));
            }
        },
        Some(other) => {
            return Err(InvalidRequest::new(
                at("role"),
                format!("must be a string, got {}", type_name(other)),
            ));
        }
        None => return Err(InvalidRequest::new(at("role"), "is required")),
    };
    let content = parse_content(i, obj.get("content"), role)?;
    let reasoning_content = match obj
        .get("reasoning_content")
        .or_else(|| obj.get("reasoning"))
    {
        None | Some(Json::Null) => None,
        Some(Json::String(s)) if role == Role::Assistant => Some(s.clone()),
        Some(Json::String(_)) => {
            return Err(InvalidRequest::new(
                at("reasoning_content"),
                "is only allowed on assistant messages",
            ));
        }
        Some(other) => {
            return Err(InvalidRequest::new(
                at("reasoning_content"),
                format!("must be a string, got {}", type_name(other)),
            ));
        }
    };
    let tool_calls = match obj.get("tool_calls") {
        None | Some(Json::Null) => Vec::new(),
        Some(Json::Array(calls)) if role == Role::Assistant => calls
            .iter()
            .enumerate()
            .map(|(j, c)| parse_tool_call(i, j, c))
            .collect::<Result<_, _>>()?,
        Some(Json::Array(_)) => {
            return Err(InvalidRequest::new(
                at("tool_calls"),
                "is only allowed on assistant messages",
            ));
        }
        Some(other) => {
            return Err(InvalidRequest::new(
                at("tool_calls"),
                format!("must be an array, got {}", type_name(other)),
            ));
        }
    };
    let tool_call_id = optional_string(obj, "tool_call_id", i)?;
    let name = optional_string(obj, "name", i)?;
    let extra = obj
        .iter()
        .filter(|(k, _)| !KNOWN_FIELDS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Ok(Message {
        role,
        content,
        reasoning_content,
        tool_calls,
        tool_call_id,
        name,
        extra,
    })
}

fn optional_string(
    obj: &Map<String, Json>,
    key: &str,
    i: usize,
) -> Result<Option<String>, InvalidRequest> {
    match obj.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(InvalidRequest::new(
            format!("messages[{i}].{key}"),
            format!("must be a string, got {}", type_name(other)),
        )),
    }
}

fn parse_content(i: usize, v: Option<&Json>, role: Role) -> Result<Content, InvalidRequest> {
    let param = format!("messages[{i}].content");
    match v {
        None | Some(Json::Null) => match role {
            Role::Assistant | Role::Tool => Ok(Content::Text(String::new())),
            _ => Err(InvalidRequest::new(
                param,
                format!("is required for {} messages", role.as_str()),
            )),
        },
        Some(Json::String(s)) => Ok(Content::Text(s.clone())),
        Some(Json::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                let pp = format!("{param}[{j}]");
                let Some(obj) = p.as_object() else {
                    return Err(InvalidRequest::new(
                        pp,
                        format!("must be an object, got {}", type_name(p)),
                    ));
                };
                match obj.get("type").and_then(Json::as_str) {
                    Some("text") => {}
                    Some(other) => {
                        return Err(InvalidRequest::new(
                            format!("{pp}.type"),
                            format!(
                                "content part type `{other}` is not supported; this model reads text only"
                            ),
                        ));
                    }
                    None => return Err(InvalidRequest::new(format!("{pp}.type"), "is required")),
                }
                match obj.get("text") {
                    Some(Json::String(t)) => texts.push(t.clone()),
                    _ => {
                        return Err(InvalidRequest::new(
                            format!("{pp}.text"),
                            "must be a string",
                        ));
                    }
                }
            }
            Ok(Content::Parts(texts))
        }
        Some(other) => Err(InvalidRequest::new(
            param,
            format!(
                "must be a string or an array of text parts, got {}",
                type_name(other)
            ),
        )),
    }
}

fn parse_tool_call(i: usize, j: usize, v: &Json) -> Result<HistoryToolCall, InvalidRequest> {
    let base = format!("messages[{i}].tool_calls[{j}]");
    let obj = v.as_object().ok_or_else(|| {
        InvalidRequest::new(&base, format!("must be an object, got {}", type_name(v)))
    })?;
    match obj.get("type") {
        None | Some(Json::Null) => {}
        Some(Json::String(t)) if t == "function" => {}
        Some(_) => {
            return Err(InvalidRequest::new(
                format!("{base}.type"),
                "must be \"function\"",
            ));
        }
    }
    let id = match obj.get("id") {
        None | Some(Json::Null) => None,
        Some(Json::String(s)) => Some(s.clone()),
        Some(other) => {
            return Err(InvalidRequest::new(
                format!("{base}.id"),
                format!("must be a string, got {}", type_name(other)),
            ));
        }
    };
    let f = obj
        .get("function")
        .and_then(Json::as_object)
        .ok_or_else(|| {
            InvalidRequest::new(
                format!("{base}.function"),
                "must be an object with `name` and `arguments`",
            )
        })?;
    let name = match f.get("name") {
        Some(Json::String(n)) if !n.is_empty() => n.clone(),
        _ => {
            return Err(InvalidRequest::new(
                format!("{base}.function.name"),
                "must be a non-empty string",
            ));
        }
    };
    let args_param = format!("{base}.function.arguments");
    let arguments = match f.get("arguments") {
        // Some clients send an empty string for calls without arguments.
        None | Some(Json::Null) => Map::new(),
        Some(Json::String(s)) if s.trim().is_empty() => Map::new(),
        Some(Json::String(s)) => match serde_json::from_str::<Json>(s) {
            Ok(Json::Object(m)) => m,
            Ok(other) => {
                return Err(InvalidRequest::new(
                    args_param,
                    format!("must be a JSON object, got {}", type_name(&other)),
                ));
            }
            Err(e) => {
                return Err(InvalidRequest::new(
                    args_param,
                    format!("is not valid JSON: {e}"),
                ));
            }
        },
        Some(Json::Object(m)) => m.clone(),
        Some(other) => {
            return Err(InvalidRequest::new(
                args_param,
                format!("must be a JSON object string, got {}", type_name(other)),
            ));
        }
    };
    Ok(HistoryToolCall {
        id,
        name,
        arguments,
    })
}

/// Conversation-shape rules: system only first; tool results answer an earlier call.
/// `caller`: the last earlier message that is not a tool result.
fn check_sequence(i: usize, msg: &Message, caller: Option<&Message>) -> Result<(), InvalidRequest> {
    match msg.role {
        Role::System if i > 0 => Err(InvalidRequest::new(
            format!("messages[{i}].role"),
            "a system or developer message is only supported as the first message",
        )),
        Role::Tool => {
            let Some(caller) =
                caller.filter(|m| m.role == Role::Assistant && !m.tool_calls.is_empty())
            else {
                return Err(InvalidRequest::new(
                    format!("messages[{i}]"),
                    "a tool message must follow an assistant message with tool_calls",
                ));
            };
            if let Some(id) = &msg.tool_call_id {
                let mut known = caller.tool_calls.iter().filter_map(|c| c.id.as_deref()).peekable();
                if known.peek().is_some() && !known.any(|k| k == id) {
                    return Err(InvalidRequest::new(
                        format!("messages[{i}].tool_call_id"),
                        format!(
                            "`{id}` does not match any tool call of the preceding assistant message"
                        ),
                    ));
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}
