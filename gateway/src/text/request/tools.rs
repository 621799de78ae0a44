//! Tool definitions, `tool_choice` and `parallel_tool_calls`.

use serde_json::Value as Json;

use super::error::{InvalidRequest, type_name};
use crate::text::toolcall::param_schema::{ParamForm, fold_nullable, resolve};

/// One function tool the model may call.
#[derive(Debug)]
pub struct ToolSpec {
    /// Function name.
    pub name: String,
    /// The `parameters` JSON schema (an empty object when absent), OpenAPI's `nullable`
    /// folded into JSON Schema so the validator reads it as the grammar does.
    pub parameters: Json,
    /// The tool object exactly as the client sent it, for the template.
    pub raw: Json,
    /// Each declared parameter's schema with its `$ref` / `allOf` resolved.
    params: serde_json::Map<String, Json>,
    /// The parameters written only as JSON (no verbatim text half), where a closing tag
    /// inside a JSON string is part of the value.
    json_only: std::collections::HashSet<String>,
    validator: Option<jsonschema::Validator>,
}

impl ToolSpec {
    /// Checks arguments against the schema; returns the first few violations.
    pub fn validate(&self, args: &Json) -> Result<(), Vec<String>> {
        let Some(v) = &self.validator else {
            return Ok(());
        };
        let errors: Vec<String> = v
            .iter_errors(args)
            .take(5)
            .map(|e| format!("{} at `{}`", e, e.instance_path()))
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// The schema of one parameter (its `$ref` / `allOf` resolved), if the tool declares it.
    pub fn param_schema(&self, key: &str) -> Option<&Json> {
        self.params.get(key)
    }

    /// Whether parameter `key` is written only as JSON ([`ParamForm::json_only`]).
    pub fn param_json_only(&self, key: &str) -> bool {
        self.json_only.contains(key)
    }
}

/// The tools of one request.
#[derive(Debug, Default)]
pub struct ToolSet {
    tools: Vec<ToolSpec>,
}

impl ToolSet {
    /// Looks a tool up by name.
    pub fn get(&self, name: &str) -> Option<&ToolSpec> {
        self.tools.iter().find(|t| t.name == name)
    }

    /// Whether no tools were given.
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    /// The tool objects for the template.
    pub fn raw(&self) -> Vec<Json> {
        self.tools.iter().map(|t| t.raw.clone()).collect()
    }

    /// The tools, in request order.
    pub fn iter(&self) -> impl Iterator<Item = &ToolSpec> {
        self.tools.iter()
    }

    /// Number of tools.
    pub fn len(&self) -> usize {
        self.tools.len()
    }
}

/// What the model is allowed or required to call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Text or calls, as the model likes.
    Auto,
    /// No tools are rendered; call-like text stays content.
    None,
    /// At least one valid call is required.
    Required,
    /// A valid call of this function is required.
    Function(String),
}

/// Most JSON nodes the `$ref`s / single-schema `allOf`s of one request's tool parameters may
/// resolve to in all (each parameter's resolved schema is kept: unbounded, a few hundred KB of
/// parameters that each refer to one large definition held gigabytes).
const MAX_RESOLVED_NODES: usize = 1 << 20;

fn nodes(v: &Json) -> usize {
    1 + match v {
        Json::Array(a) => a.iter().map(nodes).sum(),
        Json::Object(o) => o.values().map(nodes).sum(),
        _ => 0,
    }
}

/// Validates `tools`: function tools with unique, XML-safe names and compilable schemas.
pub fn parse_tools(v: Option<&Json>) -> Result<ToolSet, InvalidRequest> {
    let items = match v {
        None | Some(Json::Null) => return Ok(ToolSet::default()),
        Some(Json::Array(a)) => a,
        Some(other) => {
            return Err(InvalidRequest::new(
                "tools",
                format!("must be an array, got {}", type_name(other)),
            ));
        }
    };
    let mut tools: Vec<ToolSpec> = Vec::with_capacity(items.len());
    // Names seen so far: a set, so a request with many tools is not quadratic to read.
    let mut names = std::collections::HashSet::with_capacity(items.len());
    let mut expanded = 0usize;
    for (i, t) in items.iter().enumerate() {
        let base = format!("tools[{i}]");
        let obj = t
            .as_object()
            .ok_or_else(|| InvalidRequest::new(&base, "must be an object"))?;
        match obj.get("type").and_then(Json::as_str) {
            Some("function") => {}
            _ => {
                return Err(InvalidRequest::new(
                    format!("{base}.type"),
                    "must be \"function\"",
                ));
            }
        }
        let f = obj
            .get("function")
            .and_then(Json::as_object)
            .ok_or_else(|| InvalidRequest::new(format!("{base}.function"), "must be an object"))?;
        let name = match f.get("name") {
            Some(Json::String(n)) if !n.is_empty() => n.clone(),
            _ => {
                return Err(InvalidRequest::new(
                    format!("{base}.function.name"),
                    "must be a non-empty string",
                ));
            }
        };
        if name.contains(['"', '<', '>', '&']) || name.chars().any(char::is_whitespace) {
            return Err(InvalidRequest::new(
                format!("{base}.function.name"),
                "must not contain quotes, angle brackets, `&` or whitespace",
            ));
        }
        if !names.insert(name.clone()) {
            return Err(InvalidRequest::new(
                format!("{base}.function.name"),
                format!("duplicate tool name `{name}`"),
            ));
        }
        let mut parameters = match f.get("parameters") {
            None | Some(Json::Null) => Json::Object(Default::default()),
            Some(p @ Json::Object(_)) => p.clone(),
            Some(other) => {
                return Err(InvalidRequest::new(
                    format!("{base}.function.parameters"),
                    format!("must be a JSON schema object, got {}", type_name(other)),
                ));
            }
        };
        fold_nullable(&mut parameters);
        let mut params = serde_json::Map::new();
        for (k, v) in parameters.get("properties").and_then(Json::as_object).into_iter().flatten() {
            let r = resolve(v, &parameters);
            // Each parameter keeps its own resolved copy: bound what references expand to.
            if v.get("$ref").is_some() || v.get("allOf").is_some() {
                expanded += nodes(&r);
                if expanded > MAX_RESOLVED_NODES {
                    return Err(InvalidRequest::new(
                        format!("{base}.function.parameters.properties.{k}"),
                        format!("the tools' parameter `$ref`s and `allOf`s expand to more than {MAX_RESOLVED_NODES} schema nodes"),
                    ));
                }
            }
            params.insert(k.clone(), r);
        }
        let json_only = params.iter().filter(|(_, r)| ParamForm::of(r, &parameters).json_only()).map(|(k, _)| k.clone()).collect();
        let validator = jsonschema::validator_for(&parameters).map_err(|e| {
            InvalidRequest::new(
                format!("{base}.function.parameters"),
                format!("is not a valid JSON schema: {e}"),
            )
        })?;
        tools.push(ToolSpec {
            name,
            parameters,
            raw: t.clone(),
            params,
            json_only,
            validator: Some(validator),
        });
    }
    Ok(ToolSet { tools })
}

/// Validates `tool_choice` against the tools; the default is `auto` with tools, else `none`.
pub fn parse_tool_choice(v: Option<&Json>, tools: &ToolSet) -> Result<ToolChoice, InvalidRequest> {
    let choice = match v {
        None | Some(Json::Null) => {
            return Ok(if tools.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            });
        }
        Some(Json::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(InvalidRequest::new(
                    "tool_choice",
                    format!(
                        "unknown value `{other}`; expected auto, none, required or a function object"
                    ),
                ));
            }
        },
        Some(Json::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Json::as_str)
                .ok_or_else(|| InvalidRequest::new("tool_choice.function.name", "is required"))?;
            if tools.get(name).is_none() {
                return Err(InvalidRequest::new(
                    "tool_choice.function.name",
                    format!("no tool named `{name}` in `tools`"),
                ));
            }
            ToolChoice::Function(name.to_string())
        }
        Some(other) => {
            return Err(InvalidRequest::new(
                "tool_choice",
                format!("must be a string or an object, got {}", type_name(other)),
            ));
        }
    };
    if matches!(choice, ToolChoice::Required) && tools.is_empty() {
        return Err(InvalidRequest::new(
            "tool_choice",
            "`required` needs at least one tool in `tools`",
        ));
    }
    if matches!(choice, ToolChoice::Auto) && tools.is_empty() {
        return Ok(ToolChoice::None);
    }
    Ok(choice)
}
