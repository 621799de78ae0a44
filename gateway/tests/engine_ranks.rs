//! The engine against REAL rank processes (`minimax-rank serve`, CPU backend, the m2-small
//! fixture): prefix reuse gives identical outputs, kill -9 of a rank fails the request with
//! RankFailure and the supervisor brings the world back, a rank with the wrong-cache-length
//! test fault gets its sequence dropped with CacheMismatch while the others continue, and a
//! one-rank world's overlapped decode gives the tokens of one step at a time.
//!
//! The rank binary: `$MINIMAX_RANK_BINARY`, else `target/debug/minimax-rank` (built with
//! `cargo build -p minimax-rank` when missing). Every wait is bounded.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{end_event, greedy_req, prompt, rank_pids, stop, tokens_and_end};
use minimax_gateway::engine::{Engine, EngineConfig, EngineError, FinishReason, GenEvent, GenerationRequest, SamplingParams, Usage};
use minimax_gateway::sched::SchedConfig;

fn config(world: usize, parallelism: &str, rank_args: Vec<(u32, Vec<String>)>) -> (EngineConfig, PathBuf) {
    let (mut w, dir) = common::spawn_world("mmx-eng", world, parallelism, 64, rank_args);
    w.max_restart_attempts = 5;
    (EngineConfig { sched: SchedConfig { prefill_chunk: 24, ..Default::default() }, world: w }, dir)
}

async fn start(world: usize, parallelism: &str, rank_args: Vec<(u32, Vec<String>)>) -> (Engine, PathBuf) {
    let (cfg, dir) = config(world, parallelism, rank_args);
    let engine = Engine::start(cfg);
    engine.wait_ready(Duration::from_secs(90)).await.expect("ranks ready");
    (engine, dir)
}

struct Outcome {
    tokens: Vec<u32>,
    finish: Result<(FinishReason, Usage), EngineError>,
}

async fn run(engine: &Engine, req: GenerationRequest) -> Outcome {
    let stream = engine.generate(req).expect("accepted");
    let events = tokio::time::timeout(Duration::from_secs(120), stream.collect_all()).await.expect("generation finished in time");
    let (tokens, finish) = tokens_and_end(events);
    Outcome { tokens, finish }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_reuse_gives_identical_outputs() {
    let (engine, dir) = start(2, "tensor", vec![]).await;
    let p = prompt(40, 1); // 2 full pages + 8 tokens
    let cold = run(&engine, greedy_req("cold", p.clone(), 8)).await;
    let (reason, usage) = cold.finish.clone().unwrap();
    assert_eq!(reason, FinishReason::Length);
    assert_eq!(usage.cached_tokens, 0);
    assert_eq!(cold.tokens.len(), 8);

    let warm = run(&engine, greedy_req("warm", p.clone(), 8)).await;
    assert_eq!(warm.finish.as_ref().unwrap().1.cached_tokens, 32);
    assert_eq!(warm.tokens, cold.tokens, "prefix reuse changed the output");

    // A follow-up turn: prompt + output + new tokens reuses 40 + 7 = 47 cached → 2 full pages.
    let turn2: Vec<u32> = [&p[..], &cold.tokens[..], &prompt(20, 2)[..]].concat();
    let t2 = run(&engine, greedy_req("turn2", turn2.clone(), 6)).await;
    assert_eq!(t2.finish.as_ref().unwrap().1.cached_tokens, 32);
    let m = engine.metrics();
    assert!(m.prefix_hit_tokens >= 64, "{m:?}");
    stop(engine, dir).await;

    // The same follow-up on a cold world gives the same tokens.
    let (engine, dir) = start(2, "tensor", vec![]).await;
    let t2_cold = run(&engine, greedy_req("turn2-cold", turn2, 6)).await;
    assert_eq!(t2_cold.finish.as_ref().unwrap().1.cached_tokens, 0);
    assert_eq!(t2_cold.tokens, t2.tokens);
    stop(engine, dir).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_a_rank_fails_the_request_and_the_world_comes_back() {
    let (engine, dir) = start(2, "pipeline", vec![]).await;
    let before = rank_pids(&dir);
    assert_eq!(before.len(), 2, "{before:?}");
    let mut stream = engine.generate(greedy_req("victim", prompt(30, 3), 4000)).unwrap();
    // Wait for generation to be under way, then kill rank 1.
    let started = tokio::time::timeout(Duration::from_secs(60), stream.recv()).await.unwrap().unwrap();
    assert!(matches!(started, GenEvent::Started { .. }), "{started:?}");
    let first = tokio::time::timeout(Duration::from_secs(60), stream.recv()).await.unwrap().unwrap();
    assert!(matches!(first, GenEvent::Token { .. }), "{first:?}");
    unsafe {
        libc::kill(before[1].1, libc::SIGKILL);
    }
    let ended = end_event(&mut stream, Duration::from_secs(30), "the request ended in time").await;
    match ended {
        Some(GenEvent::Failed(EngineError::RankFailure(msg))) => assert!(msg.contains("rank"), "{msg}"),
        other => panic!("expected RankFailure, got {other:?}"),
    }
    // New requests are refused while restarting, never hang.
    match engine.generate(greedy_req("too-early", prompt(5, 1), 2)) {
        Err(EngineError::NotReady(_)) => {}
        Ok(s) => assert!(matches!(s.collect_all().await.last(), Some(GenEvent::Finished { .. })), "accepted only when ready"),
        Err(e) => panic!("{e:?}"),
    }
    engine.wait_ready(Duration::from_secs(90)).await.expect("the world came back");
    let after = rank_pids(&dir);
    assert_eq!(after.len(), 2);
    assert!(after.iter().all(|(_, p)| !before.iter().any(|(_, q)| q == p)), "every rank was restarted: {before:?} → {after:?}");
    let ok = run(&engine, greedy_req("after", prompt(20, 4), 5)).await;
    assert_eq!(ok.finish.unwrap().0, FinishReason::Length);
    assert_eq!(ok.tokens.len(), 5);
    let m = engine.metrics();
    assert_eq!(m.rank_restarts, 1);
    assert!(engine.health().iter().all(|h| h.state == "ready"));
    stop(engine, dir).await;
    assert!(rank_pids(&std::env::temp_dir().join("none")).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_cache_length_drops_that_sequence_only() {
    // Rank 1 records a wrong length for the first sequence of its 4th step.
    let fault = vec![(1u32, vec!["--test-fault".to_string(), "wrong-cache-len-after-steps:3".to_string()])];
    let (engine, dir) = start(2, "tensor", fault).await;
    let a = engine.generate(greedy_req("a", prompt(10, 5), 12)).unwrap();
    let b = engine.generate(greedy_req("b", prompt(12, 6), 12)).unwrap();
    let (ea, eb) = tokio::time::timeout(Duration::from_secs(120), async { tokio::join!(a.collect_all(), b.collect_all()) }).await.unwrap();
    let fin = |ev: &Vec<GenEvent>| ev.last().cloned().unwrap();
    let (fa, fb) = (fin(&ea), fin(&eb));
    let (failed, other) = if matches!(fa, GenEvent::Failed(_)) { (fa, fb) } else { (fb, fa) };
    match failed {
        GenEvent::Failed(EngineError::CacheMismatch(msg)) => assert!(msg.contains("rank 1"), "{msg}"),
        e => panic!("expected one CacheMismatch, got {e:?} and {other:?}"),
    }
    assert!(matches!(other, GenEvent::Finished { reason: FinishReason::Length, usage: Usage { completion_tokens: 12, .. }, .. }), "{other:?}");
    assert_eq!(engine.metrics().cache_mismatches, 1);
    // The world is intact: the next request runs.
    let ok = run(&engine, greedy_req("c", prompt(9, 7), 3)).await;
    assert_eq!(ok.tokens.len(), 3);
    stop(engine, dir).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_rank_overlapped_decode_gives_the_tokens_of_one_step_at_a_time() {
    // Greedy, seeded sampling with penalties (the rank adds each token it feeds to their
    // history), a stop token and several requests at once, with overlap off and on.
    let sampled = |seed: u64| SamplingParams { temperature: 0.8, top_k: 30, seed: Some(seed), frequency_penalty: 0.6, presence_penalty: 0.3, repetition_penalty: 1.2, ..Default::default() };
    let mut runs = vec![];
    for overlap in [false, true] {
        let (mut cfg, dir) = config(1, "tensor", vec![]);
        cfg.sched.overlap = overlap;
        let engine = Engine::start(cfg);
        engine.wait_ready(Duration::from_secs(90)).await.expect("rank ready");
        let probe = run(&engine, greedy_req("probe", prompt(30, 5), 12)).await;
        let mut with_stop = greedy_req("stop", prompt(30, 5), 12);
        with_stop.stop_token_ids = vec![probe.tokens[4]];
        let reqs = vec![
            with_stop,
            GenerationRequest { request_id: "s1".into(), prompt: prompt(17, 6), max_tokens: 20, sampling: sampled(11), stop_token_ids: vec![] },
            GenerationRequest { request_id: "s2".into(), prompt: prompt(45, 7), max_tokens: 16, sampling: sampled(12), stop_token_ids: vec![] },
            greedy_req("g", prompt(9, 8), 14),
        ];
        let outs = futures_util::future::join_all(reqs.into_iter().map(|r| run(&engine, r))).await;
        let m = engine.metrics();
        assert_eq!(m.steps_in_flight_max, if overlap { 2 } else { 1 }, "overlap {overlap}: {m:?}");
        let mut all = vec![(probe.tokens, probe.finish.map(|f| f.0))];
        all.extend(outs.into_iter().map(|o| (o.tokens, o.finish.map(|f| f.0))));
        runs.push(all);
        stop(engine, dir).await;
    }
    let stop_run = &runs[0][1];
    assert_eq!(stop_run.1, Ok(FinishReason::Stop));
    assert_eq!(stop_run.0.len(), 4, "the stop token ends the output before it");
    for (i, (a, b)) in runs[0].iter().zip(&runs[1]).enumerate() {
        assert_eq!(a, b, "request {i}: overlap changed the output");
    }
    assert_eq!(runs[0][2].0.len(), 20);
}

/// Structured outputs in a one-rank world (the fixture's own vocabulary): with late rules a
/// constrained sequence's next step is sent before its token is known and its rule follows
/// with the step after (the rank's forward runs meanwhile, its reduction waits for the rule);
/// the tokens are those of one step at a time (overlap off, and overlap with late rules off),
/// greedy and seeded sampled, alone and two at once, and every output is a valid prefix of
/// the schema's documents (a whole one where it stopped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_rank_structured_outputs_with_late_rules_give_the_tokens_of_one_step_at_a_time() {
    use std::sync::Arc;

    use minimax_gateway::constrain::schema::Grammar;
    use minimax_gateway::constrain::vocab::TokenIndex;
    use minimax_gateway::constrain::{ConstraintSpec, Mode};
    use minimax_gateway::text::format::ModelFormat;
    use minimax_gateway::text::tokenizer::Tokenizer;

    let tok = Tokenizer::from_gguf(common::root().join("fixtures/m2-small/q8_0.gguf"), &ModelFormat::minimax_m2()).expect("tokenizer");
    let index = Arc::new(TokenIndex::new(&tok));
    // Items with no room for whitespace inside them (random weights favour it).
    let schema = serde_json::json!({
        "type": "array",
        "items": {"type": "string", "pattern": "^[a-z0-9]{3,6}$"},
        "minItems": 2,
        "maxItems": 4
    });
    let spec = Arc::new(ConstraintSpec { grammar: Grammar::from_schema(&schema).unwrap(), index: index.clone(), reasoning: None, starts_in_reasoning: false, mode: Mode::Document });
    // And a request's own logit bias against whitespace tokens, which each rule is merged with.
    let blank: std::collections::HashMap<u32, f32> = (0..index.vocab() as u32).filter(|&t| !index.token_bytes(t).is_empty() && index.token_bytes(t).iter().all(u8::is_ascii_whitespace)).map(|t| (t, -30.0)).collect();
    assert!(!blank.is_empty());
    let req = |id: &str, salt: u32, temperature: f32, seed: u64| GenerationRequest {
        request_id: id.into(),
        prompt: prompt(12, salt),
        max_tokens: 40,
        sampling: SamplingParams { temperature, top_k: 40, seed: Some(seed), constraint: Some(spec.clone()), logit_bias: blank.clone(), ..Default::default() },
        stop_token_ids: index.eog().to_vec(),
    };
    let mut runs = vec![];
    for (overlap, late) in [(false, false), (true, false), (true, true)] {
        let (mut cfg, dir) = config(1, "tensor", vec![]);
        cfg.sched.overlap = overlap;
        cfg.sched.late_rules = late;
        let engine = Engine::start(cfg);
        engine.wait_ready(Duration::from_secs(90)).await.expect("rank ready");
        let mut all = vec![run(&engine, req("alone", 3, 0.0, 1)).await];
        let pair = futures_util::future::join_all([req("g", 4, 0.0, 2), req("s", 5, 0.9, 3)].map(|r| run(&engine, r))).await;
        all.extend(pair);
        let m = engine.metrics();
        assert_eq!(m.late_rules > 0, overlap && late, "overlap {overlap}, late rules {late}: {m:?}");
        runs.push(all.into_iter().map(|o| (o.tokens, o.finish.map(|f| f.0))).collect::<Vec<_>>());
        stop(engine, dir).await;
    }
    assert_eq!(runs[0], runs[1], "overlap without late rules changed the outputs");
    assert_eq!(runs[0], runs[2], "late rules changed the outputs");
    for (tokens, finish) in &runs[0] {
        let bytes: Vec<u8> = tokens.iter().flat_map(|&t| index.token_bytes(t).to_vec()).collect();
        let text = String::from_utf8_lossy(&bytes);
        assert!(tokens.len() >= 8, "{} tokens: {text}", tokens.len());
        let mut state = minimax_gateway::constrain::matcher::State::start(&spec.grammar);
        assert!(state.feed(&spec.grammar, &bytes), "not a prefix of a document: {text}");
        if *finish == Ok(FinishReason::Stop) {
            let doc: serde_json::Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text}"));
            let items = doc.as_array().unwrap_or_else(|| panic!("{text}"));
            assert!((2..=4).contains(&items.len()), "{text}");
            assert!(items.iter().all(|v| v.as_str().is_some_and(|s| (3..=6).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()))), "{text}");
        }
    }
}
