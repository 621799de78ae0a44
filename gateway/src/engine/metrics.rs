//! Engine counters and gauges, updated by the scheduler and read at `/metrics` scrape time.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::FinishReason;

/// Shared atomics (the engine loop writes, anyone reads).
#[derive(Debug, Default)]
pub struct Metrics {
    pub queue_depth: AtomicU64,
    pub running: AtomicU64,
    pub kv_pages_total: AtomicU64,
    pub kv_pages_used: AtomicU64,
    pub kv_pages_free: AtomicU64,
    pub kv_pages_cached: AtomicU64,
    pub kv_evictions: AtomicU64,
    pub prefix_lookup_tokens: AtomicU64,
    pub prefix_hit_tokens: AtomicU64,
    /// Prompt (and recomputed) tokens the ranks processed.
    pub prompt_tokens_computed: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub finished_stop: AtomicU64,
    pub finished_length: AtomicU64,
    pub failed: AtomicU64,
    pub cancelled: AtomicU64,
    pub rejected_queue_full: AtomicU64,
    pub cache_mismatches: AtomicU64,
    pub preemptions: AtomicU64,
    pub steps: AtomicU64,
    /// Steps sent to the ranks and not answered yet, and the most seen at once.
    pub steps_in_flight: AtomicU64,
    pub steps_in_flight_max: AtomicU64,
    /// Rules sent after their rows (late rules: structured outputs in overlapped decode).
    pub late_rules: AtomicU64,
    /// Where served step time goes (see [`StepTimes`]).
    pub step_tokens: AtomicU64,
    pub step_wall_us: AtomicU64,
    pub step_rank_us: AtomicU64,
    pub step_gap_us: AtomicU64,
}

impl Metrics {
    pub(crate) fn finished(&self, reason: FinishReason) {
        match reason {
            FinishReason::Stop => self.finished_stop.fetch_add(1, Relaxed),
            FinishReason::Length => self.finished_length.fetch_add(1, Relaxed),
        };
    }
}

/// A point-in-time copy of the engine's metrics.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MetricsSnapshot {
    /// Requests waiting for admission.
    pub queue_depth: u64,
    /// Sequences admitted and running.
    pub running_sequences: u64,
    pub kv_pages_total: u64,
    /// Pages referenced by running sequences.
    pub kv_pages_used: u64,
    /// Pages an allocation can get (free + evictable cached).
    pub kv_pages_free: u64,
    /// Pages holding a reusable prefix.
    pub kv_pages_cached: u64,
    pub kv_evictions: u64,
    pub prefix_lookup_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub prompt_tokens_computed: u64,
    pub generated_tokens: u64,
    pub finished_stop: u64,
    pub finished_length: u64,
    pub failed: u64,
    pub cancelled: u64,
    pub rejected_queue_full: u64,
    pub cache_mismatches: u64,
    pub preemptions: u64,
    pub steps: u64,
    /// Steps sent to the ranks and not answered yet (pipeline worlds keep several).
    pub steps_in_flight: u64,
    /// The most steps in flight at once since the start.
    pub steps_in_flight_max: u64,
    /// Rules sent after their rows (late rules).
    pub late_rules: u64,
    pub step_times: StepTimes,
    pub rank_restarts: u64,
    pub ranks_ready: u64,
    pub world_size: u64,
}

/// Sums over the steps sent so far that say where a served step's time goes: the ranks'
/// own compute (forward + sampling reductions, as the head rank reports it), the rest of the
/// round trip (gRPC, agreement), and the engine's own work between an answer and the next
/// step when nothing else was in flight (scheduling, sampling, streaming out).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTimes {
    pub steps: u64,
    /// Tokens the steps carried (prompt chunks and decoded tokens).
    pub tokens: u64,
    /// Send to last answer, per step.
    pub wall_us: u64,
    /// The head rank's `compute_ms` of each answered step.
    pub rank_us: u64,
    /// Answer to the next send while no step was in flight (the engine's serial overhead).
    pub gap_us: u64,
}

impl MetricsSnapshot {
    /// Cached prompt tokens / looked-up prompt tokens (0 before any lookup).
    pub fn prefix_cache_hit_ratio(&self) -> f64 {
        if self.prefix_lookup_tokens == 0 { 0.0 } else { self.prefix_hit_tokens as f64 / self.prefix_lookup_tokens as f64 }
    }

    pub(crate) fn from(m: &Metrics) -> Self {
        Self {
            queue_depth: m.queue_depth.load(Relaxed),
            running_sequences: m.running.load(Relaxed),
            kv_pages_total: m.kv_pages_total.load(Relaxed),
            kv_pages_used: m.kv_pages_used.load(Relaxed),
            kv_pages_free: m.kv_pages_free.load(Relaxed),
            kv_pages_cached: m.kv_pages_cached.load(Relaxed),
            kv_evictions: m.kv_evictions.load(Relaxed),
            prefix_lookup_tokens: m.prefix_lookup_tokens.load(Relaxed),
            prefix_hit_tokens: m.prefix_hit_tokens.load(Relaxed),
            prompt_tokens_computed: m.prompt_tokens_computed.load(Relaxed),
            generated_tokens: m.generated_tokens.load(Relaxed),
            finished_stop: m.finished_stop.load(Relaxed),
            finished_length: m.finished_length.load(Relaxed),
            failed: m.failed.load(Relaxed),
            cancelled: m.cancelled.load(Relaxed),
            rejected_queue_full: m.rejected_queue_full.load(Relaxed),
            cache_mismatches: m.cache_mismatches.load(Relaxed),
            preemptions: m.preemptions.load(Relaxed),
            steps: m.steps.load(Relaxed),
            steps_in_flight: m.steps_in_flight.load(Relaxed),
            steps_in_flight_max: m.steps_in_flight_max.load(Relaxed),
            late_rules: m.late_rules.load(Relaxed),
            step_times: StepTimes {
                steps: m.steps.load(Relaxed),
                tokens: m.step_tokens.load(Relaxed),
                wall_us: m.step_wall_us.load(Relaxed),
                rank_us: m.step_rank_us.load(Relaxed),
                gap_us: m.step_gap_us.load(Relaxed),
            },
            rank_restarts: 0,
            ranks_ready: 0,
            world_size: 0,
        }
    }
}
