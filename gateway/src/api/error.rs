//! OpenAI-style error bodies: `{"error":{"message","type","param","code"}}` with the right
//! HTTP status. 422 is never used: every client mistake is a 400 naming the field.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::engine::EngineError;
use crate::text::prompt::PrepareError;
use crate::text::request::InvalidRequest;

/// An error answered to the client.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, ...
    pub kind: &'static str,
    /// The offending request field, OpenAI-style (`messages[2].content`).
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, param: None, code: None }
    }

    /// 400 naming the field.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        let param = param.into();
        let message = message.into();
        let message = if param.is_empty() { message } else { format!("{param}: {message}") };
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message,
            kind: "invalid_request_error",
            param: (!param.is_empty()).then_some(param),
            code: None,
        }
    }

    /// 400 for a known field whose value we do not support (yet).
    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> Self {
        let mut e = Self::invalid(param, message);
        e.code = Some("unsupported_value");
        e
    }

    pub fn unauthorized() -> Self {
        let mut e = Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid or missing API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`)",
        );
        e.code = Some("invalid_api_key");
        e
    }

    pub fn model_not_found(model: &str, served: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model `{model}` does not exist; this server serves `{served}`"),
        );
        e.param = Some("model".into());
        e.code = Some("model_not_found");
        e
    }

    pub fn route_not_found(method: &str, path: &str) -> Self {
        let mut e = Self::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("no route for {method} {path}"));
        e.code = Some("unknown_url");
        e
    }

    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        let mut e =
            Self::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", format!("{method} is not allowed on {path}"));
        e.code = Some("method_not_allowed");
        e
    }

    pub fn too_large(limit: usize) -> Self {
        let mut e = Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("request body is larger than the limit of {limit} bytes (--max-body-bytes)"),
        );
        e.code = Some("request_too_large");
        e
    }

    pub fn timeout(secs: f64) -> Self {
        let mut e = Self::new(
            StatusCode::GATEWAY_TIMEOUT,
            "timeout_error",
            format!("request did not finish within the server's timeout of {secs} s (--request-timeout)"),
        );
        e.code = Some("timeout");
        e
    }

    /// A bug of ours.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, self.body().to_string()).into_response();
        r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

impl From<InvalidRequest> for ApiError {
    fn from(e: InvalidRequest) -> Self {
        ApiError::invalid(e.param, e.message)
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let message = e.to_string();
        match e {
            EngineError::QueueFull(_) => {
                let mut a = ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message);
                a.code = Some("queue_full");
                a
            }
            EngineError::NotReady(_) => {
                let mut a = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", message);
                a.code = Some("model_not_ready");
                a
            }
            EngineError::RankFailure(_) => {
                let mut a = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", message);
                a.code = Some("rank_failure");
                a
            }
            EngineError::PromptTooLong { .. } => {
                let mut a = ApiError::invalid("messages", message);
                a.message = e.to_string();
                a.code = Some("context_length_exceeded");
                a
            }
            EngineError::InvalidRequest(m) => ApiError::invalid("", m),
            EngineError::CacheMismatch(_) | EngineError::Internal(_) => ApiError::internal(message),
        }
    }
}

impl From<PrepareError> for ApiError {
    fn from(e: PrepareError) -> Self {
        match e {
            PrepareError::Invalid(i) => i.into(),
            other => ApiError::internal(other.to_string()),
        }
    }
}

/// The `{"error":...}` object sent as an SSE event when a stream fails after it started.
pub fn stream_error_event(e: &ApiError) -> serde_json::Value {
    let mut body = e.body();
    body["error"]["status"] = json!(e.status.as_u16());
    body
}

/// A JSON response with `status`.
pub fn json_response(status: StatusCode, v: &serde_json::Value) -> Response {
    let mut r = (status, v.to_string()).into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}
