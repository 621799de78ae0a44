//! Errors as the Anthropic API sends them: `{"type":"error","error":{"type","message"}}` with
//! the same HTTP status as the OpenAI endpoints (the message still names the field).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value as Json, json};

use crate::api::error::ApiError;

/// Anthropic's error `type` for a status.
pub fn kind(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 405 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        504 => "timeout_error",
        _ => "api_error",
    }
}

/// The error body (also the data of a stream's `error` event).
pub fn body(e: &ApiError) -> Json {
    json!({"type": "error", "error": {"type": kind(e.status), "message": e.message}})
}

/// The error response. A 502 (the model did not make the call `tool_choice` demanded) or 504
/// (the server's timeout) says `x-should-retry: false`: the SDKs retry 5xx, and a retry
/// would run the whole generation again for the same outcome.
pub fn response(e: &ApiError) -> Response {
    let mut r = (e.status, body(e).to_string()).into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if matches!(e.status.as_u16(), 502 | 504) {
        r.headers_mut().insert("x-should-retry", HeaderValue::from_static("false"));
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_anthropic_types() {
        let e = ApiError::invalid("messages[0].role", "must be `user` or `assistant`");
        assert_eq!(body(&e), json!({"type": "error", "error": {"type": "invalid_request_error", "message": "messages[0].role: must be `user` or `assistant`"}}));
        assert_eq!(kind(ApiError::unauthorized().status), "authentication_error");
        assert_eq!(kind(StatusCode::TOO_MANY_REQUESTS), "rate_limit_error");
        assert_eq!(kind(StatusCode::SERVICE_UNAVAILABLE), "overloaded_error");
        assert_eq!(kind(StatusCode::GATEWAY_TIMEOUT), "timeout_error");
        assert_eq!(kind(StatusCode::INTERNAL_SERVER_ERROR), "api_error");
        let r = response(&ApiError::timeout(1.0));
        assert_eq!(r.headers()["x-should-retry"], "false");
        assert!(response(&ApiError::invalid("x", "y")).headers().get("x-should-retry").is_none());
    }
}
