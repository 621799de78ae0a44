//! Several steps in flight in a served pipeline world, against REAL rank processes
//! (`minimax-rank serve`, CPU backend, the m2-small fixture, two stages): concurrent greedy
//! streams give exactly the tokens of a single-rank world and of the same world run one step
//! at a time (`pipeline_inflight: 1`), the engine really had two steps outstanding, a
//! cancelled stream or a step the ranks refuse leaves the other sequence groups intact, and
//! kill -9 of a stage with steps in flight fails every stream and the world comes back.
//!
//! The rank binary: `$MINIMAX_RANK_BINARY`, else `target/debug/minimax-rank` (built with
//! `cargo build -p minimax-rank` when missing). Every wait is bounded.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{end_event, greedy_req, prompt, rank_pids, stop, tokens_and_end};
use minimax_gateway::engine::{Engine, EngineConfig, EngineError, FinishReason, GenEvent, GenerationRequest};
use minimax_gateway::sched::SchedConfig;

/// A world of `world` CPU ranks (pipeline stages) keeping `inflight` steps in flight (0: one
/// per stage); a world of one runs one step at a time (no overlapped decode).
async fn start(world: usize, inflight: usize) -> (Engine, PathBuf) {
    let (mut w, dir) = common::spawn_world("mmx-pipe", world, "pipeline", 128, vec![]);
    w.max_restart_attempts = 2;
    let sched = SchedConfig { prefill_chunk: 24, pipeline_inflight: inflight, overlap: false, ..Default::default() };
    let engine = Engine::start(EngineConfig { sched, world: w });
    engine.wait_ready(Duration::from_secs(90)).await.expect("ranks ready");
    (engine, dir)
}

/// A stream's tokens and how it ended.
#[derive(Debug, Clone, PartialEq)]
struct Outcome {
    tokens: Vec<u32>,
    finish: Result<FinishReason, EngineError>,
}

async fn collect(stream: minimax_gateway::engine::GenStream) -> Outcome {
    let events = tokio::time::timeout(Duration::from_secs(180), stream.collect_all()).await.expect("generation finished in time");
    let (tokens, finish) = tokens_and_end(events);
    Outcome { tokens, finish: finish.map(|(reason, _)| reason) }
}

/// The requests every world runs at once: prompts of different lengths (prefill chunks and
/// decode steps mix), greedy.
fn workload() -> Vec<GenerationRequest> {
    (0..4u32).map(|i| greedy_req(&format!("r{i}"), prompt(20 + 9 * i as usize, i + 1), 14)).collect()
}

async fn run_concurrently(engine: &Engine, reqs: Vec<GenerationRequest>) -> Vec<Outcome> {
    let streams: Vec<_> = reqs.into_iter().map(|r| engine.generate(r).expect("accepted")).collect();
    futures_util::future::join_all(streams.into_iter().map(collect)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stages_with_steps_in_flight_match_one_rank_and_survive_cancel_and_refusal() {
    // The reference: one rank, one step at a time.
    let (one, dir) = start(1, 0).await;
    let reference = run_concurrently(&one, workload()).await;
    let long_ref = run_concurrently(&one, vec![greedy_req("long", prompt(30, 9), 40)]).await.remove(0);
    assert_eq!(one.metrics().steps_in_flight_max, 1);
    stop(one, dir).await;
    for o in &reference {
        assert_eq!(o.finish, Ok(FinishReason::Length), "{o:?}");
        assert_eq!(o.tokens.len(), 14);
    }

    // The same pipeline world one step at a time (today's behaviour, --pipeline-inflight 1).
    let (serial, dir) = start(2, 1).await;
    assert_eq!(run_concurrently(&serial, workload()).await, reference, "pipeline 2, one step at a time, differs from one rank");
    assert_eq!(serial.metrics().steps_in_flight_max, 1);
    stop(serial, dir).await;

    // Two stages, two steps of disjoint groups in flight (the default: one per stage).
    let (pipe, dir) = start(2, 0).await;
    let got = run_concurrently(&pipe, workload()).await;
    assert_eq!(got, reference, "pipeline 2 with steps in flight differs from one rank");
    let m = pipe.metrics();
    assert_eq!(m.steps_in_flight_max, 2, "the engine never had two steps outstanding: {m:?}");
    assert_eq!(m.steps_in_flight, 0);
    assert_eq!(m.rank_restarts, 0);

    // Cancellation: one stream is dropped after a few tokens while the others run; they keep
    // their exact tokens and the world keeps serving.
    let keep_a = pipe.generate(greedy_req("keep-a", prompt(30, 9), 40)).unwrap();
    let mut victim = pipe.generate(greedy_req("victim", prompt(25, 7), 200)).unwrap();
    let keep_b = pipe.generate(workload().remove(2)).unwrap();
    let mut seen = 0;
    while seen < 3 {
        match tokio::time::timeout(Duration::from_secs(60), victim.recv()).await.expect("victim streams").expect("victim open") {
            GenEvent::Token { .. } => seen += 1,
            GenEvent::Started { .. } => {}
            other => panic!("victim ended early: {other:?}"),
        }
    }
    drop(victim);
    let (a, b) = tokio::join!(collect(keep_a), collect(keep_b));
    assert_eq!(a, long_ref, "a cancelled neighbour changed a stream");
    assert_eq!(b, reference[2]);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while pipe.metrics().cancelled == 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(pipe.metrics().cancelled, 1);

    // A request the ranks refuse (an invalid sampling parameter the head rank rejects) fails
    // alone: with two sequences running each step holds one, so the other group goes on.
    let good = pipe.generate(greedy_req("good", prompt(30, 9), 40)).unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut bad_req = greedy_req("bad", prompt(12, 5), 5);
    bad_req.sampling.temperature = -1.0;
    let bad = pipe.generate(bad_req).unwrap();
    let (g, b) = tokio::join!(collect(good), collect(bad));
    assert_eq!(g, long_ref, "a refused neighbour changed a stream");
    match &b.finish {
        Err(EngineError::Internal(msg)) => assert!(msg.contains("temperature"), "{msg}"),
        other => panic!("expected the bad request to fail alone, got {other:?}"),
    }
    let m = pipe.metrics();
    assert_eq!(m.rank_restarts, 0, "a refused step must not restart the world");
    assert!(pipe.ready());
    // And the world still gives the reference tokens.
    assert_eq!(run_concurrently(&pipe, workload()).await, reference);
    stop(pipe, dir).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_a_stage_with_steps_in_flight_fails_everything_and_the_world_comes_back() {
    let (pipe, dir) = start(2, 0).await;
    let before = rank_pids(&dir);
    assert_eq!(before.len(), 2, "{before:?}");
    let mut streams: Vec<_> = (0..3u32).map(|i| pipe.generate(greedy_req(&format!("v{i}"), prompt(20, i + 30), 4000)).unwrap()).collect();
    // Every stream is under way (so both groups have steps in flight), then stage 0 dies.
    for s in &mut streams {
        loop {
            match tokio::time::timeout(Duration::from_secs(60), s.recv()).await.expect("streaming").expect("open") {
                GenEvent::Token { .. } => break,
                GenEvent::Started { .. } => {}
                other => panic!("ended early: {other:?}"),
            }
        }
    }
    assert_eq!(pipe.metrics().steps_in_flight_max, 2);
    unsafe {
        libc::kill(before[0].1, libc::SIGKILL);
    }
    for mut s in streams {
        let end = end_event(&mut s, Duration::from_secs(30), "every stream ended in time").await;
        assert!(matches!(end, Some(GenEvent::Failed(EngineError::RankFailure(_)))), "{end:?}");
    }
    pipe.wait_ready(Duration::from_secs(90)).await.expect("the world came back");
    assert_eq!(pipe.metrics().rank_restarts, 1);
    assert!(serves_reference_tokens(&pipe).await, "the restarted world gives one rank's tokens");
    stop(pipe, dir).await;
}

/// After a restart the world serves the concurrent workload with a single rank's tokens
/// (compared with a fresh one-rank world).
async fn serves_reference_tokens(pipe: &Engine) -> bool {
    let got = run_concurrently(pipe, workload()).await;
    let (one, dir) = start(1, 0).await;
    let want = run_concurrently(&one, workload()).await;
    stop(one, dir).await;
    got == want
}

/// Aggregate decode throughput on the CPU: one rank, two stages one step at a time, two
/// stages with two steps in flight (each stage is one single-threaded process). Prints the
/// figures; run with `--ignored --nocapture` on a machine with at least two free cores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn cpu_throughput_one_rank_vs_two_stages() {
    // (prompt tokens, new tokens): decode-heavy, then prefill-heavy (distinct prompts each run).
    for (plen, new) in [(16, 48), (200, 2)] {
        let reqs = |salt: u32| (0..8u32).map(|i| greedy_req(&format!("t{i}"), prompt(plen, i + salt), new)).collect::<Vec<_>>();
        for (world, inflight) in [(1, 0), (2, 1), (2, 0)] {
            let (engine, dir) = start(world, inflight).await;
            run_concurrently(&engine, reqs(20)).await; // warm-up
            let t0 = std::time::Instant::now();
            let out = run_concurrently(&engine, reqs(40)).await;
            let secs = t0.elapsed().as_secs_f64();
            let toks = out.len() * plen + out.iter().map(|o| o.tokens.len()).sum::<usize>();
            let m = engine.metrics();
            eprintln!("{plen}+{new} x8: world {world}, steps in flight {}: {toks} tokens in {secs:.2} s = {:.1} tok/s", m.steps_in_flight_max, toks as f64 / secs);
            stop(engine, dir).await;
        }
    }
}
