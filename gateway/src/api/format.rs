//! Structured-output requests of every protocol (`response_format`, `text.format`,
//! `output_config.format`) read into one compiled [`Grammar`] (docs/API.md "Structured outputs").

use serde_json::Value as Json;

use super::error::ApiError;
use super::params::type_name;
use super::state::AppState;
use std::sync::Arc;

use crate::constrain::schema::{CallTags, CallTool, Grammar, SchemaError};
use crate::constrain::{ConstraintSpec, Mode};
use crate::engine::SamplingParams;
use crate::text::prompt::PreparedChat;
use crate::text::request::ToolChoice;

/// `sampling` with the structured output's constraint for this prompt (the document starts
/// after the reasoning block when the prompt opens one). A tool choice that demands a call is
/// refused: the answer is the document, never a call (`field` names the format in the error).
pub fn constrained(st: &AppState, grammar: Option<Grammar>, prepared: &PreparedChat, mut sampling: SamplingParams, field: &str) -> Result<SamplingParams, ApiError> {
    let out = &prepared.output;
    let must_call = matches!(out.tool_choice, ToolChoice::Required | ToolChoice::Function(_));
    let Some(g) = grammar else {
        // No structured output: guided tool calls, where asked for.
        let guided = match st.args.guided_tool_calls.as_str() {
            "always" => out.tool_choice != ToolChoice::None,
            "required" => must_call,
            _ => false,
        };
        if guided && !out.tools.is_empty() {
            sampling.constraint = tool_constraint(st, prepared, must_call);
        }
        return Ok(sampling);
    };
    if must_call {
        return Err(ApiError::invalid(
            field,
            "a structured output cannot be combined with a tool choice that requires a call (the answer is the JSON document); use tool_choice `auto` or `none`",
        ));
    }
    sampling.constraint = Some(st.constraint(g, out.starts_in_reasoning, Mode::Document));
    Ok(sampling)
}

/// The tool-call grammar of a request: its tools (only the named one for a named choice), at
/// most one invoke a block when calls may not run in parallel. `None` (unguided) when no call
/// of any of them can be completed (a required parameter whose schema admits no value).
fn tool_constraint(st: &AppState, prepared: &PreparedChat, must_call: bool) -> Option<Arc<ConstraintSpec>> {
    let out = &prepared.output;
    let tags = &st.text.format().tool_calls;
    let tools: Vec<CallTool<'_>> = out
        .tools
        .iter()
        .filter(|t| match &out.tool_choice {
            ToolChoice::Function(name) => &t.name == name,
            _ => true,
        })
        .map(|t| CallTool { name: &t.name, parameters: &t.parameters })
        .collect();
    let call_tags = CallTags {
        invoke_open: tags.invoke_open,
        invoke_close: tags.invoke_close,
        param_open: tags.param_open,
        param_close: tags.param_close,
        block_close: tags.block_close,
    };
    let max = if out.parallel_tool_calls { 64 } else { 1 };
    let g = Grammar::tool_calls(&tools, call_tags, max)?;
    let mode = Mode::ToolCalls { open: tags.block_open.as_bytes().to_vec(), must_call };
    Some(st.constraint(g, out.starts_in_reasoning, mode))
}

/// The schema error as a 400 naming the field and the place inside the schema.
fn schema_error(field: &str, e: SchemaError) -> ApiError {
    let inner = e.path.trim_start_matches('#').trim_start_matches('/').replace('/', ".");
    let param = if inner.is_empty() { field.to_string() } else { format!("{field}.{inner}") };
    ApiError::invalid(param, format!("{} (structured outputs)", e.why))
}

fn schema_of(v: Option<&Json>, field: &str) -> Result<Grammar, ApiError> {
    match v {
        None => Err(ApiError::invalid(field, "is required")),
        Some(s @ (Json::Object(_) | Json::Bool(_))) => Grammar::from_schema(s).map_err(|e| schema_error(field, e)),
        Some(v) => Err(ApiError::invalid(field, format!("must be a JSON Schema object, got {}", type_name(v)))),
    }
}

/// A format field's object, `None` when absent or null.
fn format_object<'a>(v: Option<&'a Json>, field: &str) -> Result<Option<&'a serde_json::Map<String, Json>>, ApiError> {
    match v {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Object(o)) => Ok(Some(o)),
        Some(v) => Err(ApiError::invalid(field, format!("must be an object, got {}", type_name(v)))),
    }
}

/// Chat completions' `response_format`: `text`, `json_object`, or
/// `json_schema` (`{"json_schema": {"name", "schema", "strict"}}`). `None`: free text.
pub fn chat_response_format(v: Option<&Json>) -> Result<Option<Grammar>, ApiError> {
    let Some(o) = format_object(v, "response_format")? else { return Ok(None) };
    match o.get("type").and_then(Json::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::any_object())),
        Some("json_schema") => {
            let js = match o.get("json_schema") {
                Some(Json::Object(js)) => js,
                Some(v) => return Err(ApiError::invalid("response_format.json_schema", format!("must be an object, got {}", type_name(v)))),
                None => return Err(ApiError::invalid("response_format.json_schema", "is required with type `json_schema`")),
            };
            check_name(js.get("name"), "response_format.json_schema.name")?;
            // No schema: any JSON value (what the format promises without one).
            match js.get("schema") {
                None => Ok(Some(Grammar::any_value())),
                s => schema_of(s, "response_format.json_schema.schema").map(Some),
            }
        }
        Some(t) => Err(ApiError::invalid("response_format.type", format!("unknown type `{t}` (expected `text`, `json_object` or `json_schema`)"))),
        None => Err(ApiError::invalid("response_format.type", "is required")),
    }
}

/// The Responses API's `text.format`: `text`, `json_object`, or `json_schema` with `name`,
/// `schema`, `strict` beside `type`.
pub fn responses_text_format(v: Option<&Json>) -> Result<Option<Grammar>, ApiError> {
    let Some(o) = format_object(v, "text.format")? else { return Ok(None) };
    match o.get("type").and_then(Json::as_str) {
        None | Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::any_object())),
        Some("json_schema") => {
            check_name(o.get("name"), "text.format.name")?;
            schema_of(o.get("schema"), "text.format.schema").map(Some)
        }
        Some(t) => Err(ApiError::invalid("text.format.type", format!("unknown type `{t}` (expected `text`, `json_object` or `json_schema`)"))),
    }
}

/// Anthropic's `output_config.format` (and the older top-level `output_format`):
/// `{"type": "json_schema", "schema": {...}}`.
pub fn anthropic_output_format(v: Option<&Json>, field: &str) -> Result<Option<Grammar>, ApiError> {
    let Some(o) = format_object(v, field)? else { return Ok(None) };
    match o.get("type").and_then(Json::as_str) {
        Some("json_schema") => schema_of(o.get("schema"), &format!("{field}.schema")).map(Some),
        Some(t) => Err(ApiError::invalid(format!("{field}.type"), format!("unknown type `{t}` (expected `json_schema`)"))),
        None => Err(ApiError::invalid(format!("{field}.type"), "is required")),
    }
}

/// OpenAI's rule for a format's name: 1-64 of `a-z A-Z 0-9 _ -` (optional here).
fn check_name(v: Option<&Json>, field: &str) -> Result<(), ApiError> {
    match v {
        None => Ok(()),
        Some(Json::String(s)) if !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') => Ok(()),
        Some(Json::String(s)) => Err(ApiError::invalid(field, format!("must be 1-64 characters of a-z, A-Z, 0-9, `_` or `-`, got {s:?}"))),
        Some(v) => Err(ApiError::invalid(field, format!("must be a string, got {}", type_name(v)))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn param(r: Result<Option<Grammar>, ApiError>) -> String {
        r.unwrap_err().param.unwrap_or_default()
    }

    #[test]
    fn errors_name_the_field_and_the_place_in_the_schema() {
        let bad = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {"a": {"not": {}}}}}});
        assert_eq!(param(chat_response_format(Some(&bad))), "response_format.json_schema.schema.properties.a.not");
        assert_eq!(param(chat_response_format(Some(&json!({"type": "xml"})))), "response_format.type");
        assert_eq!(param(chat_response_format(Some(&json!({"type": "json_schema"})))), "response_format.json_schema");
        let bad_name = json!({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}});
        assert_eq!(param(chat_response_format(Some(&bad_name))), "response_format.json_schema.name");
        assert_eq!(param(responses_text_format(Some(&json!({"type": "json_schema", "name": "x"})))), "text.format.schema");
        assert_eq!(param(anthropic_output_format(Some(&json!({"type": "json_schema", "schema": 3})), "output_config.format")), "output_config.format.schema");
    }

    #[test]
    fn formats_compile() {
        assert!(chat_response_format(Some(&json!({"type": "text"}))).unwrap().is_none());
        assert!(chat_response_format(Some(&json!({"type": "json_object"}))).unwrap().is_some());
        let s = json!({"type": "json_schema", "json_schema": {"name": "w", "strict": true, "schema": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": false}}});
        assert!(chat_response_format(Some(&s)).unwrap().is_some());
        assert!(responses_text_format(Some(&json!({"type": "json_schema", "name": "w", "schema": {"type": "array"}}))).unwrap().is_some());
    }
}
