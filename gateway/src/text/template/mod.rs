//! Chat templates rendered with minijinja, configured to match Python jinja2 the way HF
//! transformers runs it (`_compile_jinja_template`): `trim_blocks`, `lstrip_blocks`,
//! loop controls, a `tojson` that is Python's `json.dumps` (no HTML escaping, key order kept),
//! `raise_exception`, `strftime_now`, Python string methods (minijinja-contrib pycompat) and
//! Python's spelling of printed values (`None`, `True`).

mod pyfloat;
mod pyjson;
mod pystr;

use std::sync::Arc;

use minijinja::value::{Kwargs, Rest, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{Map, Value as Json};

pub use pyfloat::python_float_repr;
pub use pyjson::{DumpsOptions, dumps};
pub use pystr::python_str;

/// Name under which the single template is stored in the environment.
const TEMPLATE_NAME: &str = "chat_template";
/// Marks errors raised by the template itself, so they map to [`TemplateError::Raised`].
const RAISED_TAG: &str = "\u{1}raise_exception:";

/// A source of "now" for `strftime_now`, injectable so tests are deterministic.
pub type Clock = Arc<dyn Fn() -> chrono::NaiveDateTime + Send + Sync>;

/// Why a template did not compile or render.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The template source does not parse.
    #[error("chat template does not compile: {0}")]
    Syntax(String),
    /// The template called `raise_exception(message)`: the conversation is not acceptable.
    #[error("{0}")]
    Raised(String),
    /// Rendering failed for another reason (type error, unknown filter, ...).
    #[error("chat template failed to render: {0}")]
    Render(String),
}

/// The variables a chat template sees, as HF's `apply_chat_template` passes them.
#[derive(Debug, Clone, Default)]
pub struct TemplateInput {
    /// `messages`: OpenAI-style message objects.
    pub messages: Vec<Json>,
    /// `tools`: tool objects as the client sent them, or `None` (rendered as `none`).
    pub tools: Option<Vec<Json>>,
    /// `add_generation_prompt`.
    pub add_generation_prompt: bool,
    /// Everything else: special-token strings (`bos_token`, ...) and `chat_template_kwargs`.
    pub extra: Map<String, Json>,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles a template with the system clock for `strftime_now`.
    pub fn new(source: impl Into<String>) -> Result<Self, TemplateError> {
        Self::with_clock(source, Arc::new(|| chrono::Local::now().naive_local()))
    }

    /// Compiles a template with a given clock.
    pub fn with_clock(source: impl Into<String>, clock: Clock) -> Result<Self, TemplateError> {
        let source = source.into();
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| TemplateError::Syntax(describe(&e)))?;
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(|out, _state, value| {
            out.write_str(&python_str(value))
                .map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()))
        });
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", move |format: String| {
            strftime_now(&clock, &format)
        });
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| TemplateError::Syntax(describe(&e)))?;
        Ok(ChatTemplate { env, source })
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders the template with the given variables.
    pub fn render(&self, input: &TemplateInput) -> Result<String, TemplateError> {
        let mut ctx = Map::new();
        // Extra variables first so the reserved names below always win.
        for (k, v) in &input.extra {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), Json::Array(input.messages.clone()));
        ctx.insert(
            "tools".into(),
            input.tools.clone().map(Json::Array).unwrap_or(Json::Null),
        );
        ctx.insert("documents".into(), Json::Null);
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(input.add_generation_prompt),
        );
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TemplateError::Syntax(describe(&e)))?;
        tmpl.render(Value::from(minijinja::value::Serde(&ctx)))
            .map_err(|e| match raised_message(&e) {
                Some(msg) => TemplateError::Raised(msg),
                None => TemplateError::Render(describe(&e)),
            })
    }
}

/// Variable names the pipeline sets itself; `chat_template_kwargs` may not override them.
pub const RESERVED_VARIABLES: &[&str] =
    &["messages", "tools", "documents", "add_generation_prompt"];

fn tojson(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    // Python signature: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
    let mut opts = DumpsOptions::default();
    let arg = |i: usize, name: &str| -> Result<Option<Value>, Error> {
        if let Some(v) = args.get(i) {
            return Ok(Some(v.clone()));
        }
        kwargs.get::<Option<Value>>(name)
    };
    if let Some(v) = arg(0, "ensure_ascii")? {
        opts.ensure_ascii = v.is_true();
    }
    if let Some(v) = arg(1, "indent")? {
        opts.indent = match v.kind() {
            minijinja::value::ValueKind::None => None,
            minijinja::value::ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
            _ => {
                let n = i64::try_from(v.clone()).map_err(|_| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an integer or string",
                    )
                })?;
                Some(" ".repeat(n.max(0) as usize))
            }
        };
    }
    if let Some(v) = arg(2, "separators")?
        && !v.is_none()
    {
        let parts: Vec<String> = v
            .try_iter()?
            .map(|p| p.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be two strings",
                )
            })?;
        let [item, key] = <[String; 2]>::try_from(parts).map_err(|_| {
            Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be two strings",
            )
        })?;
        opts.separators = Some((item, key));
    }
    if let Some(v) = arg(3, "sort_keys")? {
        opts.sort_keys = v.is_true();
    }
    kwargs.assert_all_used()?;
    if value.is_undefined() {
        return Err(Error::new(
            ErrorKind::UndefinedError,
            "tojson of an undefined value",
        ));
    }
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))?;
    Ok(Value::from(dumps(&json, &opts)))
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED_TAG}{message}"),
    ))
}

fn strftime_now(clock: &Clock, format: &str) -> Result<Value, Error> {
    use std::fmt::Write;
    let mut out = String::new();
    write!(out, "{}", clock().format(format)).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: bad format {format:?}"),
        )
    })?;
    Ok(Value::from(out))
}

/// Finds a `raise_exception` message in an error or its causes.
fn raised_message(err: &Error) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(mj) = e.downcast_ref::<Error>()
            && let Some(detail) = mj.detail()
            && let Some(msg) = detail.strip_prefix(RAISED_TAG)
        {
            return Some(msg.to_string());
        }
        cur = e.source();
    }
    None
}

/// A one-line description with the template line, for operators fixing a template.
fn describe(err: &Error) -> String {
    let mut s = err.to_string();
    let mut cur = std::error::Error::source(err);
    while let Some(e) = cur {
        s.push_str(": ");
        s.push_str(&e.to_string());
        cur = e.source();
    }
    s
}
