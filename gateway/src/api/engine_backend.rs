//! The real engine behind the HTTP layer, and the startup glue `main.rs` calls.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use minimax_shared::gguf::Metadata;

use super::backend::{Backend, EngineStats, EventStream};
use super::config::ApiArgs;
use super::state::{AppState, ModelMeta, unix_now};
use crate::engine::{Engine, EngineError, GenerationRequest, RankHealth, ScoreResult};
use crate::text::prompt::TextPipeline;

impl Backend for Engine {
    fn generate(&self, req: GenerationRequest) -> Result<EventStream, EngineError> {
        Engine::generate(self, req).map(|s| Box::pin(s) as EventStream)
    }

    fn score(&self, request_id: String, tokens: Vec<u32>) -> BoxFuture<'static, Result<ScoreResult, EngineError>> {
        let e = self.clone();
        Box::pin(async move { Engine::score(&e, request_id, tokens).await })
    }

    fn health(&self) -> Vec<RankHealth> {
        Engine::health(self)
    }

    fn stats(&self) -> EngineStats {
        let m = self.metrics();
        EngineStats {
            queue_depth: m.queue_depth,
            running_sequences: m.running_sequences,
            kv_pages_used: m.kv_pages_used,
            kv_pages_free: m.kv_pages_free,
            kv_pages_cached: m.kv_pages_cached,
            prefix_lookup_tokens: m.prefix_lookup_tokens,
            prefix_hit_tokens: m.prefix_hit_tokens,
            rank_restarts: m.rank_restarts,
            ranks_ready: m.ranks_ready,
            steps_in_flight: m.steps_in_flight,
            steps_in_flight_max: m.steps_in_flight_max,
            late_rules: m.late_rules,
            step_times: m.step_times,
        }
    }
}

/// The model id, context length and owner from the GGUF metadata and flags.
pub fn model_meta(meta: &Metadata, args: &ApiArgs) -> ModelMeta {
    let arch = meta.get("general.architecture").and_then(|v| v.as_str()).unwrap_or("minimax-m2").to_string();
    let ctx = meta
        .get(&format!("{arch}.context_length"))
        .and_then(|v| v.as_u64())
        .unwrap_or(4096) as u32;
    let id = args
        .served_model_name
        .clone()
        .or_else(|| meta.get("general.name").and_then(|v| v.as_str()).map(str::to_string))
        .unwrap_or_else(|| arch.clone());
    let owned_by = meta
        .get("general.organization")
        .and_then(|v| v.as_str())
        .map(str::to_string)
        .unwrap_or_else(|| "minimax-serve".to_string());
    ModelMeta { id, context_length: ctx, owned_by, created: unix_now() }
}

/// Builds the HTTP state for a started engine: text pipeline from the GGUF metadata and the
/// `--chat-template-*` / `--reasoning-format` flags.
pub fn app_state(engine: Engine, meta: &Metadata, args: ApiArgs) -> anyhow::Result<AppState> {
    let text = TextPipeline::from_gguf_metadata(meta, args.pipeline_config()?)?;
    let model = model_meta(meta, &args);
    Ok(AppState::new(Arc::new(engine), Arc::new(text), model, args))
}

/// Serves the OpenAI API for `engine` until Ctrl-C / SIGTERM. `main.rs` calls this once the
/// engine is started (the HTTP server answers 503 until the ranks are ready).
pub async fn run(engine: Engine, meta: &Metadata, args: ApiArgs) -> anyhow::Result<()> {
    let st = app_state(engine, meta, args)?;
    super::serve(st, shutdown_signal()).await
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
    tracing::info!("shutting down");
}
