//! Shared state of the HTTP server.

use std::sync::Arc;

use super::backend::Backend;
use super::config::ApiArgs;
use super::metrics::Metrics;
use crate::constrain::{ConstraintSpec, Mode};
use crate::constrain::schema::Grammar;
use crate::constrain::vocab::TokenIndex;
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
    /// The vocabulary as structured outputs' masks see it (built once at start).
    pub token_index: Arc<TokenIndex>,
}

impl AppState {
    pub fn new(backend: Arc<dyn Backend>, text: Arc<TextPipeline>, model: ModelMeta, args: ApiArgs) -> Self {
        let token_index = Arc::new(TokenIndex::new(text.tokenizer()));
        AppState {
            token_index,
            backend,
            text,
            model: Arc::new(model),
            metrics: Arc::new(Metrics::default()),
            sampling_defaults: Arc::new(args.sampling_defaults()),
            args: Arc::new(args),
        }
    }
}

impl AppState {
    /// A structured output's constraint for a prompt that ends inside a reasoning block
    /// (`starts_in_reasoning`: the document starts after its closing tag) or not.
    pub fn constraint(&self, grammar: Grammar, starts_in_reasoning: bool, mode: Mode) -> Arc<ConstraintSpec> {
        let tags = &self.text.format().reasoning;
        let reasoning = (!tags.open.is_empty() && !tags.close.is_empty()).then(|| (tags.open.as_bytes().to_vec(), tags.close.as_bytes().to_vec()));
        Arc::new(ConstraintSpec { grammar, index: self.token_index.clone(), reasoning, starts_in_reasoning, mode })
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
