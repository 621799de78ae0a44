//! What the HTTP layer needs from the engine, as a trait: the real engine implements it (see
//! `engine_backend.rs`), tests use scripted fakes.

use std::pin::Pin;

use futures_util::future::BoxFuture;
use futures_util::Stream;

use crate::engine::{EngineError, GenEvent, GenerationRequest, RankHealth, ScoreResult};

/// A generation's events; dropping it cancels the sequence and frees its pages.
pub type EventStream = Pin<Box<dyn Stream<Item = GenEvent> + Send>>;

/// Engine gauges and counters read at `/metrics` scrape time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub queue_depth: u64,
    pub running_sequences: u64,
    pub kv_pages_used: u64,
    pub kv_pages_free: u64,
    pub kv_pages_cached: u64,
    pub prefix_lookup_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub rank_restarts: u64,
    pub ranks_ready: u64,
    /// Steps sent to the ranks and not answered yet, and the most at once (pipeline worlds).
    pub steps_in_flight: u64,
    pub steps_in_flight_max: u64,
    /// Rules sent after their rows (late rules: structured outputs in overlapped decode).
    pub late_rules: u64,
    /// Where served step time goes (sums since the start).
    pub step_times: crate::engine::metrics::StepTimes,
}

impl EngineStats {
    pub fn prefix_cache_hit_ratio(&self) -> f64 {
        if self.prefix_lookup_tokens == 0 { 0.0 } else { self.prefix_hit_tokens as f64 / self.prefix_lookup_tokens as f64 }
    }
}

/// The engine as the HTTP layer sees it.
pub trait Backend: Send + Sync + 'static {
    /// Queues a generation. Errors that are known at once (queue full, not ready, prompt too
    /// long) come back here; later ones arrive as `GenEvent::Failed`.
    fn generate(&self, req: GenerationRequest) -> Result<EventStream, EngineError>;

    /// Teacher-forced scoring of `tokens` (first token unscored). Must not evict other
    /// requests' cached prefixes.
    fn score(&self, request_id: String, tokens: Vec<u32>) -> BoxFuture<'static, Result<ScoreResult, EngineError>>;

    /// Every rank's state.
    fn health(&self) -> Vec<RankHealth>;

    fn stats(&self) -> EngineStats;
}
