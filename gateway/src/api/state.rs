//! Shared state of the HTTP server.

use std::sync::Arc;

use super::backend::Backend;
use super::config::ApiArgs;
use super::metrics::Metrics;
use crate::engine::SamplingParams;
use crate::text::prompt::TextPipeline;

/// What `/v1/models` reports and requests are checked against.
#[derive(Debug, Clone)]
pub struct ModelMeta {
    /// `--served-model-name` or the GGUF's `general.name`.
    pub id: String,
    /// Tokens, from the GGUF (`<arch>.context_length`).
    pub context_length: u32,
    pub owned_by: String,
    /// Unix seconds the server started.
    pub created: u64,
}

/// Everything a handler needs; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub backend: Arc<dyn Backend>,
    pub text: Arc<TextPipeline>,
    pub model: Arc<ModelMeta>,
    pub metrics: Arc<Metrics>,
    pub args: Arc<ApiArgs>,
    pub sampling_defaults: Arc<SamplingParams>,
}

impl AppState {
    pub fn new(backend: Arc<dyn Backend>, text: Arc<TextPipeline>, model: ModelMeta, args: ApiArgs) -> Self {
        AppState {
            backend,
            text,
            model: Arc::new(model),
            metrics: Arc::new(Metrics::default()),
            sampling_defaults: Arc::new(args.sampling_defaults()),
            args: Arc::new(args),
        }
    }
}

/// Unix time in seconds.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A random id like `chatcmpl-3f9a…` (24 hex digits).
pub fn new_id(prefix: &str) -> String {
    use rand::Rng;
    let mut rng = rand::rng();
    let a: u64 = rng.random();
    let b: u32 = rng.random();
    format!("{prefix}-{a:016x}{b:08x}")
}
