//! Reading a JSON body ourselves: size limit → 413, malformed JSON → 400, wrong top-level type
//! → 400. axum's own `Json` extractor answers 415/422 with plain text, which OpenAI clients do
//! not expect.

use axum::body::Body;
use axum::http::{HeaderMap, header};
use http_body_util::BodyExt;
use serde_json::{Map, Value as Json};

use super::error::ApiError;

/// Reads the whole body (at most `limit` bytes) and parses it as a JSON object.
pub async fn json_object(headers: &HeaderMap, body: Body, limit: usize) -> Result<Map<String, Json>, ApiError> {
    if let Some(len) = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|s| s.parse::<u64>().ok())
        && len > limit as u64
    {
        return Err(ApiError::too_large(limit));
    }
    let mut body = body;
    let mut buf = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ApiError::invalid("", format!("could not read the request body: {e}")))?;
        if let Ok(data) = frame.into_data() {
            if buf.len() + data.len() > limit {
                return Err(ApiError::too_large(limit));
            }
            buf.extend_from_slice(&data);
        }
    }
    if buf.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid("", "the request body is empty; send a JSON object"));
    }
    match serde_json::from_slice::<Json>(&buf) {
        Ok(Json::Object(m)) => Ok(m),
        Ok(other) => Err(ApiError::invalid("", format!("the request body must be a JSON object, got {}", super::params::type_name(&other)))),
        Err(e) => Err(ApiError::invalid("", format!("the request body is not valid JSON: {e}"))),
    }
}
