//! The OpenAI-compatible HTTP API (axum): request validation, SSE framing, errors, metrics.
//!
//! Handlers read JSON bodies themselves (`body.rs`) so every client mistake is a 400 naming
//! the field, never axum's 415/422. They turn requests into token prompts with the text
//! pipeline, run them on a [`Backend`] (the engine) through [`run::Run`], and encode the
//! updates as one JSON response or as server-sent events. See `docs/API.md`.

pub mod backend;
pub mod body;
pub mod chat;
pub mod common;
pub mod completions;
pub mod config;
pub mod engine_backend;
pub mod error;
pub mod format;
pub mod messages;
pub mod metrics;
pub mod misc;
pub mod params;
pub mod perplexity;
pub mod responses;
#[cfg(test)]
mod hostile_input_tests;
pub mod run;
pub mod sse;
pub mod state;
pub mod stop;

use std::future::Future;

use axum::Router;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{Method, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

pub use backend::{Backend, EngineStats, EventStream};
pub use config::ApiArgs;
pub use error::ApiError;
pub use state::{AppState, ModelMeta};

/// All routes.
pub fn router(st: AppState) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat::handler))
        .route("/v1/completions", post(completions::handler))
        .route("/v1/messages", post(messages::handler))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/v1/responses", post(responses::handler))
        .route("/v1/perplexity", post(perplexity::handler))
        .route("/v1/models", get(misc::models))
        .route("/v1/models/{id}", get(misc::model))
        .route_layer(middleware::from_fn_with_state(st.clone(), auth));
    Router::new()
        .merge(v1)
        .route("/health", get(misc::health))
        .route("/metrics", get(misc::metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(st.clone(), count))
        .with_state(st)
}

/// Binds `--host:--port` and serves until `shutdown` resolves.
pub async fn serve(st: AppState, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
    let addr = st.args.bind_addr()?;
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?;
    tracing::info!(model = %st.model.id, "serving the OpenAI API on http://{}", listener.local_addr()?);
    axum::serve(listener, router(st)).with_graceful_shutdown(shutdown).await?;
    Ok(())
}

/// `--api-key`: /v1/* requires `Authorization: Bearer <key>` or, as Anthropic clients send it,
/// `x-api-key: <key>` (`/health` and `/metrics` stay open for probes and scrapers).
async fn auth(State(st): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.args.api_key {
        let h = req.headers();
        let bearer = h
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim);
        let x_api_key = h.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim);
        let ok = |g: Option<&str>| g.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes()));
        if !(ok(bearer) || ok(x_api_key)) {
            return shaped_for(req.uri().path(), ApiError::unauthorized());
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Counts requests by endpoint and status.
async fn count(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let endpoint = req.extensions().get::<MatchedPath>().map(|p| p.as_str().to_string()).unwrap_or_else(|| "other".into());
    let resp = next.run(req).await;
    st.metrics.request(&endpoint, resp.status().as_u16());
    resp
}

async fn not_found(method: Method, uri: axum::http::Uri) -> Response {
    shaped_for(uri.path(), ApiError::route_not_found(method.as_str(), uri.path()))
}

async fn method_not_allowed(method: Method, uri: axum::http::Uri) -> Response {
    shaped_for(uri.path(), ApiError::method_not_allowed(method.as_str(), uri.path()))
}

/// An error in the shape of the API the path belongs to (Anthropic under `/v1/messages`).
fn shaped_for(path: &str, e: ApiError) -> Response {
    if path.starts_with("/v1/messages") { messages::error::response(&e) } else { e.into_response() }
}
