//! The typed 400 error every request-validation step returns.

/// A client error naming the offending field, e.g. `messages[3].tool_calls[0].function.arguments`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{param}: {message}")]
pub struct InvalidRequest {
    /// OpenAI-style path of the offending field (becomes the error's `param`).
    pub param: String,
    /// What is wrong, in words a client developer can act on.
    pub message: String,
}

impl InvalidRequest {
    /// Builds an error for `param`.
    pub fn new(param: impl Into<String>, message: impl Into<String>) -> Self {
        InvalidRequest {
            param: param.into(),
            message: message.into(),
        }
    }
}

/// JSON type name for error messages.
pub(crate) fn type_name(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}
