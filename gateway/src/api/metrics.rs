//! Prometheus text exposition: counters and histograms the HTTP layer measures, plus gauges
//! read from the engine at scrape time.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

use super::backend::EngineStats;

/// Seconds; TTFT spans prefill, inter-token latency spans one decode step.
const TTFT_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
const ITL_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5];
const E2E_BUCKETS: &[f64] = &[0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];

#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0 }
    }

    fn observe(&mut self, v: f64) {
        for (i, b) in self.bounds.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str) {
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

#[derive(Debug)]
struct Inner {
    requests: BTreeMap<(String, u16), u64>,
    prompt_tokens: u64,
    cached_tokens: u64,
    generation_tokens: u64,
    cancelled: u64,
    finish: BTreeMap<&'static str, u64>,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
}

/// The HTTP layer's metrics registry.
#[derive(Debug)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            inner: Mutex::new(Inner {
                requests: BTreeMap::new(),
                prompt_tokens: 0,
                cached_tokens: 0,
                generation_tokens: 0,
                cancelled: 0,
                finish: BTreeMap::new(),
                ttft: Histogram::new(TTFT_BUCKETS),
                itl: Histogram::new(ITL_BUCKETS),
                e2e: Histogram::new(E2E_BUCKETS),
            }),
        }
    }
}

impl Metrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One HTTP request finished (headers sent) with this status.
    pub fn request(&self, endpoint: &str, status: u16) {
        *self.lock().requests.entry((endpoint.to_string(), status)).or_default() += 1;
    }

    pub fn prompt(&self, prompt_tokens: u64, cached_tokens: u64) {
        let mut m = self.lock();
        m.prompt_tokens += prompt_tokens;
        m.cached_tokens += cached_tokens;
    }

    pub fn generated(&self, tokens: u64) {
        self.lock().generation_tokens += tokens;
    }

    pub fn finished(&self, reason: &'static str) {
        *self.lock().finish.entry(reason).or_default() += 1;
    }

    pub fn cancelled(&self) {
        self.lock().cancelled += 1;
    }

    pub fn ttft(&self, secs: f64) {
        self.lock().ttft.observe(secs);
    }

    pub fn inter_token(&self, secs: f64) {
        self.lock().itl.observe(secs);
    }

    pub fn e2e(&self, secs: f64) {
        self.lock().e2e.observe(secs);
    }

    /// The Prometheus text page.
    pub fn render(&self, engine: &EngineStats) -> String {
        let m = self.lock();
        let mut o = String::new();
        let head = |o: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(o, "# HELP {name} {help}");
            let _ = writeln!(o, "# TYPE {name} {kind}");
        };
        head(&mut o, "minimax_requests_total", "counter", "HTTP requests by endpoint and status code.");
        for ((ep, st), n) in &m.requests {
            let _ = writeln!(o, "minimax_requests_total{{endpoint=\"{ep}\",status=\"{st}\"}} {n}");
        }
        head(&mut o, "minimax_request_finish_total", "counter", "Finished choices by finish_reason.");
        for (r, n) in &m.finish {
            let _ = writeln!(o, "minimax_request_finish_total{{reason=\"{r}\"}} {n}");
        }
        head(&mut o, "minimax_requests_cancelled_total", "counter", "Generations cancelled by a client disconnect or timeout.");
        let _ = writeln!(o, "minimax_requests_cancelled_total {}", m.cancelled);
        head(&mut o, "minimax_prompt_tokens_total", "counter", "Prompt tokens of finished requests.");
        let _ = writeln!(o, "minimax_prompt_tokens_total {}", m.prompt_tokens);
        head(&mut o, "minimax_cached_prompt_tokens_total", "counter", "Prompt tokens served from the prefix cache.");
        let _ = writeln!(o, "minimax_cached_prompt_tokens_total {}", m.cached_tokens);
        head(&mut o, "minimax_generation_tokens_total", "counter", "Generated tokens.");
        let _ = writeln!(o, "minimax_generation_tokens_total {}", m.generation_tokens);
        head(&mut o, "minimax_time_to_first_token_seconds", "histogram", "Time from request arrival to the first generated token.");
        m.ttft.render(&mut o, "minimax_time_to_first_token_seconds");
        head(&mut o, "minimax_inter_token_latency_seconds", "histogram", "Time between consecutive generated tokens of one sequence.");
        m.itl.render(&mut o, "minimax_inter_token_latency_seconds");
        head(&mut o, "minimax_request_duration_seconds", "histogram", "Time from request arrival to the last token.");
        m.e2e.render(&mut o, "minimax_request_duration_seconds");
        drop(m);

        let e = engine;
        head(&mut o, "minimax_queue_depth", "gauge", "Requests waiting to be admitted.");
        let _ = writeln!(o, "minimax_queue_depth {}", e.queue_depth);
        head(&mut o, "minimax_running_sequences", "gauge", "Sequences in the running batch.");
        let _ = writeln!(o, "minimax_running_sequences {}", e.running_sequences);
        head(&mut o, "minimax_kv_pages_used", "gauge", "KV cache pages in use (including cached prefix pages).");
        let _ = writeln!(o, "minimax_kv_pages_used {}", e.kv_pages_used);
        head(&mut o, "minimax_kv_pages_free", "gauge", "KV cache pages free.");
        let _ = writeln!(o, "minimax_kv_pages_free {}", e.kv_pages_free);
        head(&mut o, "minimax_kv_pages_cached", "gauge", "Unreferenced pages kept by the prefix cache (evictable).");
        let _ = writeln!(o, "minimax_kv_pages_cached {}", e.kv_pages_cached);
        head(&mut o, "minimax_prefix_cache_hit_ratio", "gauge", "Prompt tokens served from the prefix cache / prompt tokens looked up.");
        let _ = writeln!(o, "minimax_prefix_cache_hit_ratio {}", e.prefix_cache_hit_ratio());
        head(&mut o, "minimax_prefix_cache_lookup_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.");
        let _ = writeln!(o, "minimax_prefix_cache_lookup_tokens_total {}", e.prefix_lookup_tokens);
        head(&mut o, "minimax_prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache.");
        let _ = writeln!(o, "minimax_prefix_cache_hit_tokens_total {}", e.prefix_hit_tokens);
        head(&mut o, "minimax_rank_restarts_total", "counter", "Times the supervisor restarted the ranks.");
        let _ = writeln!(o, "minimax_rank_restarts_total {}", e.rank_restarts);
        head(&mut o, "minimax_ranks_ready", "gauge", "Ranks in the ready state.");
        let _ = writeln!(o, "minimax_ranks_ready {}", e.ranks_ready);
        head(&mut o, "minimax_steps_in_flight", "gauge", "Steps sent to the ranks and not answered yet (pipeline worlds keep several).");
        let _ = writeln!(o, "minimax_steps_in_flight {}", e.steps_in_flight);
        head(&mut o, "minimax_steps_in_flight_max", "gauge", "The most steps in flight at once since the start.");
        let _ = writeln!(o, "minimax_steps_in_flight_max {}", e.steps_in_flight_max);
        head(&mut o, "minimax_late_rules_total", "counter", "Structured outputs' rules sent after their rows (overlapped decode with late rules).");
        let _ = writeln!(o, "minimax_late_rules_total {}", e.late_rules);
        let t = &e.step_times;
        head(&mut o, "minimax_steps_total", "counter", "Steps sent to the ranks.");
        let _ = writeln!(o, "minimax_steps_total {}", t.steps);
        head(&mut o, "minimax_step_tokens_total", "counter", "Tokens the steps carried (prompt chunks and decoded tokens).");
        let _ = writeln!(o, "minimax_step_tokens_total {}", t.tokens);
        let secs = |us: u64| us as f64 / 1e6;
        head(&mut o, "minimax_step_seconds_total", "counter", "Step round trips, send to the last rank's answer.");
        let _ = writeln!(o, "minimax_step_seconds_total {}", secs(t.wall_us));
        head(&mut o, "minimax_step_rank_compute_seconds_total", "counter", "The head rank's compute time of the answered steps (forward and sampling reductions).");
        let _ = writeln!(o, "minimax_step_rank_compute_seconds_total {}", secs(t.rank_us));
        head(&mut o, "minimax_step_gap_seconds_total", "counter", "Engine time between an answer and the next step while no step was in flight.");
        let _ = writeln!(o, "minimax_step_gap_seconds_total {}", secs(t.gap_us));
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_histograms_and_gauges() {
        let m = Metrics::default();
        m.request("/v1/chat/completions", 200);
        m.request("/v1/chat/completions", 200);
        m.request("/v1/completions", 400);
        m.ttft(0.03);
        m.inter_token(0.5);
        let text = m.render(&EngineStats { queue_depth: 3, kv_pages_free: 7, prefix_lookup_tokens: 10, prefix_hit_tokens: 5, ..Default::default() });
        assert!(text.contains("minimax_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 2\n"));
        assert!(text.contains("minimax_requests_total{endpoint=\"/v1/completions\",status=\"400\"} 1\n"));
        assert!(text.contains("minimax_time_to_first_token_seconds_bucket{le=\"0.025\"} 0\n"));
        assert!(text.contains("minimax_time_to_first_token_seconds_bucket{le=\"0.05\"} 1\n"));
        assert!(text.contains("minimax_time_to_first_token_seconds_bucket{le=\"+Inf\"} 1\n"));
        assert!(text.contains("minimax_inter_token_latency_seconds_count 1\n"));
        assert!(text.contains("minimax_queue_depth 3\n"));
        assert!(text.contains("minimax_kv_pages_free 7\n"));
        assert!(text.contains("minimax_prefix_cache_hit_ratio 0.5\n"));
        // Every sample line belongs to a declared family.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap();
            let base = name.trim_end_matches("_bucket").trim_end_matches("_sum").trim_end_matches("_count");
            assert!(text.contains(&format!("# TYPE {base} ")) || text.contains(&format!("# TYPE {name} ")), "{line}");
        }
    }
}
