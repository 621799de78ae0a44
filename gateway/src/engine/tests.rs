//! The engine loop against the in-process fake world: admission errors, cancellation,
//! world failure and recovery, scoring.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::ranks::fake::{FakeConfig, FakeWorld};

fn greedy(id: &str, prompt: Vec<u32>, max_tokens: u32) -> GenerationRequest {
    GenerationRequest { request_id: id.into(), prompt, max_tokens, sampling: SamplingParams { temperature: 0.0, ..Default::default() }, stop_token_ids: vec![] }
}

fn engine(cfg: FakeConfig, sched: SchedConfig) -> (Engine, Arc<FakeWorld>) {
    let w = Arc::new(FakeWorld::new(cfg));
    (Engine::with_world(w.clone(), sched), w)
}

async fn finish(s: GenStream) -> Vec<GenEvent> {
    tokio::time::timeout(Duration::from_secs(20), s.collect_all()).await.expect("finished in time")
}

#[tokio::test]
async fn generates_and_reports_usage_and_metrics() {
    let (e, _w) = engine(FakeConfig::default(), SchedConfig::default());
    assert!(e.ready());
    assert_eq!(e.model_info().unwrap().context_length, 256);
    let ev = finish(e.generate(greedy("a", (1..10).collect(), 5)).unwrap()).await;
    assert_eq!(ev.len(), 7);
    assert_eq!(ev[0], GenEvent::Started { cached_tokens: 0 });
    match ev.last().unwrap() {
        GenEvent::Finished { reason, usage, .. } => {
            assert_eq!(*reason, FinishReason::Length);
            assert_eq!(usage.prompt_tokens, 9);
            assert_eq!(usage.completion_tokens, 5);
        }
        other => panic!("{other:?}"),
    }
    let again = finish(e.generate(greedy("b", (1..10).collect(), 5)).unwrap()).await;
    assert_eq!(again[0], GenEvent::Started { cached_tokens: 8 }, "reported before any token");
    assert_eq!(again[1..6], ev[1..6]);
    assert!(matches!(again.last(), Some(GenEvent::Finished { usage: Usage { cached_tokens: 8, .. }, .. })));
    let m = e.metrics();
    assert_eq!(m.generated_tokens, 10);
    assert_eq!(m.finished_length, 2);
    assert_eq!(m.prefix_hit_tokens, 8);
    assert!(m.prefix_cache_hit_ratio() > 0.0);
    assert_eq!(m.running_sequences, 0);
    assert_eq!(m.kv_pages_used, 0);
}

#[tokio::test]
async fn immediate_errors() {
    let (e, _w) = engine(FakeConfig { context: 32, ..Default::default() }, SchedConfig { max_queue: 2, ..Default::default() });
    assert_eq!(e.generate(greedy("long", vec![1; 32], 1)).err(), Some(EngineError::PromptTooLong { prompt: 32, context: 32 }));
    assert!(matches!(e.generate(greedy("empty", vec![], 1)).err(), Some(EngineError::InvalidRequest(_))));
    assert!(matches!(e.generate(greedy("vocab", vec![1000], 1)).err(), Some(EngineError::InvalidRequest(_))));
    // max_tokens 0: finishes at once.
    let ev = finish(e.generate(greedy("zero", vec![1, 2], 0)).unwrap()).await;
    assert!(matches!(ev.as_slice(), [GenEvent::Finished { reason: FinishReason::Length, .. }]));
}

#[tokio::test]
async fn queue_limit_answers_queue_full() {
    let (e, _w) = engine(FakeConfig { step_delay: Duration::from_millis(20), ..Default::default() }, SchedConfig { max_queue: 2, max_running: 1, ..Default::default() });
    let mut streams = vec![];
    let mut full = 0;
    for i in 0..6 {
        match e.generate(greedy(&format!("r{i}"), vec![1, 2, 3], 20)) {
            Ok(s) => streams.push(s),
            Err(EngineError::QueueFull(_)) => full += 1,
            Err(other) => panic!("{other:?}"),
        }
    }
    assert!(full >= 3, "{full} refused");
    for s in streams {
        assert!(matches!(finish(s).await.last(), Some(GenEvent::Finished { .. })));
    }
    assert!(e.metrics().rejected_queue_full >= 3);
}

#[tokio::test]
async fn dropping_the_stream_cancels_and_frees_pages() {
    let (e, w) = engine(FakeConfig { step_delay: Duration::from_millis(5), ..Default::default() }, SchedConfig::default());
    let mut s = e.generate(greedy("a", (1..30).collect(), 200)).unwrap();
    assert!(matches!(s.recv().await, Some(GenEvent::Started { .. })));
    assert!(matches!(s.recv().await, Some(GenEvent::Token { .. })));
    drop(s);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while (e.metrics().running_sequences > 0 || w.live_sequences() > 0) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let m = e.metrics();
    assert_eq!(m.running_sequences, 0);
    assert_eq!(m.kv_pages_used, 0);
    assert_eq!(m.cancelled, 1);
    assert_eq!(w.live_sequences(), 0, "the ranks forgot the sequence");
}

#[tokio::test]
async fn world_crash_fails_in_flight_then_serves_again() {
    let (e, w) = engine(FakeConfig { step_delay: Duration::from_millis(5), restart_delay: Duration::from_millis(100), ..Default::default() }, SchedConfig::default());
    let mut s = e.generate(greedy("victim", (1..30).collect(), 500)).unwrap();
    assert!(matches!(s.recv().await, Some(GenEvent::Started { .. })));
    assert!(matches!(s.recv().await, Some(GenEvent::Token { .. })));
    w.crash("rank 1 (pid 42) was killed by signal 9 (SIGKILL)");
    let end = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match s.recv().await {
                Some(GenEvent::Token { .. }) => continue,
                other => return other,
            }
        }
    })
    .await
    .unwrap();
    match end {
        Some(GenEvent::Failed(EngineError::RankFailure(m))) => assert!(m.contains("SIGKILL"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(!e.ready() || e.world_info().unwrap().generation == 2);
    let info = e.wait_ready(Duration::from_secs(5)).await.unwrap();
    assert_eq!(info.generation, 2);
    let ev = finish(e.generate(greedy("after", (1..10).collect(), 3)).unwrap()).await;
    assert!(matches!(ev.last(), Some(GenEvent::Finished { usage: Usage { cached_tokens: 0, .. }, .. })), "the prefix cache was dropped: {ev:?}");
    assert_eq!(e.metrics().rank_restarts, 1);
}

#[tokio::test]
async fn score_returns_one_logprob_per_token_after_the_first() {
    let (e, w) = engine(FakeConfig::default(), SchedConfig { prefill_chunk: 7, ..Default::default() });
    let toks: Vec<u32> = (5..40).collect();
    let r = e.score("s".into(), toks.clone()).await.unwrap();
    assert_eq!(r.logprobs.len(), toks.len() - 1);
    let l = w.logits(&toks[..3]);
    let lse = minimax_shared::sampling::logsumexp(&l);
    assert!((r.logprobs[2] - (l[toks[3] as usize] - lse)).abs() < 1e-4);
    assert_eq!(e.score("one".into(), vec![3]).await.unwrap().logprobs.len(), 0);
    assert_eq!(e.metrics().kv_pages_cached, 0);
}

#[tokio::test]
async fn crash_while_idle_is_noticed_and_the_new_world_is_used() {
    let (e, w) = engine(FakeConfig { restart_delay: Duration::from_millis(50), ..Default::default() }, SchedConfig::default());
    finish(e.generate(greedy("a", (1..10).collect(), 2)).unwrap()).await;
    tokio::time::sleep(Duration::from_millis(20)).await; // the loop is idle
    w.crash("rank 0 restarted");
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(matches!(e.generate(greedy("early", vec![1, 2], 2)).err(), Some(EngineError::NotReady(_))));
    assert_eq!(e.wait_ready(Duration::from_secs(5)).await.unwrap().generation, 2);
    let ev = finish(e.generate(greedy("b", (1..10).collect(), 2)).unwrap()).await;
    assert!(matches!(ev.last(), Some(GenEvent::Finished { .. })), "{ev:?}");
}

/// Tokens of each stream, in order (a failed stream ends with `None`).
async fn tokens_of(streams: Vec<GenStream>) -> Vec<(Vec<u32>, Option<EngineError>)> {
    let mut out = vec![];
    for s in streams {
        let mut toks = vec![];
        let mut err = None;
        for e in finish(s).await {
            match e {
                GenEvent::Token { id, .. } => toks.push(id),
                GenEvent::Failed(e) => err = Some(e),
                _ => {}
            }
        }
        out.push((toks, err));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_worlds_keep_several_steps_in_flight_with_the_same_tokens() {
    let prompts: Vec<Vec<u32>> = (0..4u32).map(|i| (1..12 + i).map(|t| (t * 7 + i * 13) % 90 + 1).collect()).collect();
    let run = |parallelism: &'static str, inflight: usize| {
        let prompts = prompts.clone();
        async move {
            let cfg = FakeConfig { parallelism, step_delay: Duration::from_millis(5), ..Default::default() };
            let (e, _w) = engine(cfg, SchedConfig { prefill_chunk: 5, pipeline_inflight: inflight, ..Default::default() });
            let streams = prompts.iter().enumerate().map(|(i, p)| e.generate(greedy(&format!("r{i}"), p.clone(), 12)).unwrap()).collect();
            (tokens_of(streams).await, e.metrics())
        }
    };
    let (one, m1) = run("tensor", 0).await;
    let (two, m2) = run("pipeline", 0).await;
    let (off, m3) = run("pipeline", 1).await;
    assert!(one.iter().all(|(t, e)| t.len() == 12 && e.is_none()), "{one:?}");
    assert_eq!(two, one, "steps in flight changed the tokens");
    assert_eq!(off, one);
    assert_eq!(m1.steps_in_flight_max, 1);
    assert_eq!(m2.steps_in_flight_max, 2, "{m2:?}");
    assert_eq!(m3.steps_in_flight_max, 1);
    assert_eq!(m2.steps_in_flight, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_step_fails_only_its_sequences() {
    let cfg = FakeConfig { parallelism: "pipeline", step_delay: Duration::from_millis(2), ..Default::default() };
    let (e, w) = engine(cfg, SchedConfig::default());
    w.set_refuse_token(95);
    let good = e.generate(greedy("good", (1..10).collect(), 8)).unwrap();
    let bad = e.generate(greedy("bad", vec![3, 95, 4], 8)).unwrap();
    let out = tokens_of(vec![good, bad]).await;
    assert_eq!(out[0].0.len(), 8);
    assert_eq!(out[0].1, None);
    assert!(matches!(&out[1].1, Some(EngineError::Internal(m)) if m.contains("refused")), "{:?}", out[1]);
    assert_eq!(e.metrics().rank_restarts, 0);
    assert!(e.ready());
}

#[tokio::test]
async fn step_times_say_where_served_time_goes() {
    let delay = Duration::from_millis(15);
    let (e, _w) = engine(FakeConfig { step_delay: delay, ..Default::default() }, SchedConfig::default());
    let ev = finish(e.generate(greedy("t", (1..10).collect(), 5)).unwrap()).await;
    assert!(matches!(ev.last(), Some(GenEvent::Finished { .. })));
    let t = e.metrics().step_times;
    // One prompt step of 9 tokens, then 4 steps of one fed-back token each.
    assert_eq!(t.steps, 5, "{t:?}");
    assert_eq!(t.tokens, 9 + 4, "{t:?}");
    assert!(t.wall_us >= t.steps * delay.as_micros() as u64, "every round trip waited the fake's step delay: {t:?}");
    assert!(t.gap_us < t.wall_us, "the engine's own work is far below the round trips: {t:?}");
    assert_eq!(t.rank_us, 0, "the fake ranks report no compute time: {t:?}");
}
