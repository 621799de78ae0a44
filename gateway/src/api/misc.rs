//! `/health`, `/v1/models`, `/metrics`.

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::state::AppState;

/// 200 `{"status":"ok",...}` only when every rank is ready; otherwise 503 with each rank's
/// state (loading with progress, restarting, failed).
pub async fn health(State(st): State<AppState>) -> Response {
    let ranks = st.backend.health();
    let ready = !ranks.is_empty() && ranks.iter().all(|r| r.state == "ready");
    let list: Vec<_> = ranks
        .iter()
        .map(|r| json!({"rank": r.rank, "state": r.state, "progress": r.progress, "detail": r.detail}))
        .collect();
    if ready {
        super::error::json_response(StatusCode::OK, &json!({"status": "ok", "ranks": list}))
    } else {
        let status = ["failed", "restarting", "loading"]
            .into_iter()
            .find(|s| ranks.iter().any(|r| r.state == *s))
            .unwrap_or(if ranks.is_empty() { "no_ranks" } else { "not_ready" });
        super::error::json_response(StatusCode::SERVICE_UNAVAILABLE, &json!({"status": status, "ranks": list}))
    }
}

pub async fn models(State(st): State<AppState>) -> Response {
    let m = &st.model;
    super::error::json_response(StatusCode::OK, &json!({
        "object": "list",
        "data": [{
            "id": m.id, "object": "model", "created": m.created, "owned_by": m.owned_by,
            "context_length": m.context_length, "max_model_len": m.context_length,
        }],
    }))
}

pub async fn model(State(st): State<AppState>, axum::extract::Path(id): axum::extract::Path<String>) -> Response {
    if id != st.model.id {
        return super::error::ApiError::model_not_found(&id, &st.model.id).into_response();
    }
    let m = &st.model;
    super::error::json_response(StatusCode::OK, &json!({
        "id": m.id, "object": "model", "created": m.created, "owned_by": m.owned_by,
        "context_length": m.context_length, "max_model_len": m.context_length,
    }))
}

pub async fn metrics(State(st): State<AppState>) -> Response {
    let text = st.metrics.render(&st.backend.stats());
    let mut r = (StatusCode::OK, text).into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
    r
}
