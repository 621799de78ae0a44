use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use super::*;
use crate::engine::{GenEvent, GenerationRequest, SamplingParams};
use crate::ranks::RankWorld;
use crate::ranks::fake::{FakeConfig, FakeWorld};

fn world(page_size: u32, n_pages: u32, context: u32) -> FakeWorld {
    FakeWorld::new(FakeConfig { page_size, n_pages, context, ..Default::default() })
}

fn sched(w: &FakeWorld, cfg: SchedConfig) -> Scheduler {
    let info = w.subscribe().borrow().ready().cloned().unwrap();
    Scheduler::new(cfg, info.page_size as usize, info.n_pages as usize, info.model.context_length as usize, Arc::new(Metrics::default()))
}

fn greedy() -> SamplingParams {
    SamplingParams { temperature: 0.0, seed: Some(0), ..Default::default() }
}

fn req(id: &str, prompt: Vec<u32>, max_tokens: u32, sampling: SamplingParams) -> GenerationRequest {
    GenerationRequest { request_id: id.into(), prompt, max_tokens, sampling, stop_token_ids: vec![] }
}

/// Submits a generation and returns its event receiver.
fn submit(s: &mut Scheduler, r: GenerationRequest) -> mpsc::UnboundedReceiver<GenEvent> {
    let (tx, rx) = mpsc::unbounded_channel();
    s.submit(Seq::generation(r, tx));
    rx
}

/// Sends the scheduler's queued rank-side releases to the fake world.
async fn flush_releases(s: &mut Scheduler, w: &FakeWorld) {
    let rel = s.take_releases();
    if !rel.is_empty() {
        w.release(1, rel).await.unwrap();
    }
}

/// Runs steps until the scheduler is idle; returns the plans' (seqs, tokens) shapes.
async fn drive(s: &mut Scheduler, w: &FakeWorld) -> Vec<Vec<(usize, LogitsMode)>> {
    let mut shapes = Vec::new();
    for _ in 0..10_000 {
        s.reap_cancelled();
        flush_releases(s, w).await;
        let Some(plan) = s.plan() else { break };
        shapes.push(plan.request.seqs.iter().map(|q| (q.tokens.len(), LogitsMode::try_from(q.logits).unwrap())).collect());
        let resp = w.step(1, plan.request.clone()).await.unwrap();
        s.complete(plan, &resp, 0);
        flush_releases(s, w).await;
        s.kv().check_invariants();
    }
    assert!(s.is_idle(), "scheduler did not drain");
    shapes
}

/// Output tokens, finish reason and usage of a finished generation.
fn outcome(rx: &mut mpsc::UnboundedReceiver<GenEvent>) -> (Vec<u32>, Option<FinishReason>, Usage, Option<EngineError>) {
    let mut toks = vec![];
    let mut reason = None;
    let mut usage = Usage::default();
    let mut err = None;
    while let Ok(e) = rx.try_recv() {
        match e {
            GenEvent::Started { .. } => {}
            GenEvent::Token { id, .. } => toks.push(id),
            GenEvent::Finished { reason: r, usage: u, .. } => {
                reason = Some(r);
                usage = u;
            }
            GenEvent::Failed(e) => err = Some(e),
        }
    }
    (toks, reason, usage, err)
}

/// The fake model's greedy continuation, computed directly (no cache, no batching).
fn reference_greedy(w: &FakeWorld, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut toks = prompt.to_vec();
    let mut out = vec![];
    for _ in 0..n {
        let l = w.logits(&toks);
        let best = (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a))).unwrap() as u32;
        out.push(best);
        toks.push(best);
    }
    out
}

#[tokio::test]
async fn scripted_prefix_reuse_counts_and_identical_outputs() {
    let w = world(4, 64, 256);
    let mut s = sched(&w, SchedConfig::default());
    let a: Vec<u32> = (1..11).collect(); // 10 tokens
    let script: Vec<(Vec<u32>, u32)> = vec![
        (a.clone(), 0),                                              // cold
        ([&a[..8], &[20, 21, 22]].concat(), 8),                      // shared 2 full pages
        ([&a[..6], &[30, 31, 32, 33, 34]].concat(), 4),              // diverges mid-page 2
        (a.clone(), 8),                                              // exact repeat
        (a[..8].to_vec(), 4),                                        // page-aligned repeat
        ((50..60).collect(), 0),                                     // unrelated
    ];
    for (i, (prompt, cached)) in script.iter().enumerate() {
        let mut rx = submit(&mut s, req(&format!("r{i}"), prompt.clone(), 5, greedy()));
        drive(&mut s, &w).await;
        let (toks, reason, usage, err) = outcome(&mut rx);
        assert_eq!(err, None);
        assert_eq!(reason, Some(FinishReason::Length));
        assert_eq!(usage.cached_tokens, *cached, "request {i}");
        assert_eq!(usage.prompt_tokens as usize, prompt.len());
        assert_eq!(toks, reference_greedy(&w, prompt, 5), "request {i}: output differs from the uncached reference");
    }
    // Follow-up turn: previous prompt + its generated tokens + new user tokens reuses the
    // pages holding prompt AND generated tokens: 10 + 5 - 1 = 14 written → 3 full pages.
    let first = reference_greedy(&w, &a, 5);
    let turn2 = [&a[..], &first[..], &[70, 71]].concat();
    let mut rx = submit(&mut s, req("turn2", turn2.clone(), 3, greedy()));
    drive(&mut s, &w).await;
    let (toks, _, usage, _) = outcome(&mut rx);
    assert_eq!(usage.cached_tokens, 12);
    assert_eq!(toks, reference_greedy(&w, &turn2, 3));
    assert_eq!(s.kv().stats().evictions, 0);
}

#[tokio::test]
async fn chunked_prefill_interleaves_with_decode_under_budget() {
    let w = world(4, 64, 256);
    let mut s = sched(&w, SchedConfig { prefill_chunk: 8, max_step_tokens: 10, ..Default::default() });
    let mut a = submit(&mut s, req("a", vec![1, 2, 3], 6, greedy()));
    // One step: a's prefill (3 tokens, logits Last) → a is decoding.
    let p = s.plan().unwrap();
    assert_eq!(p.request.seqs.len(), 1);
    let r = w.step(1, p.request.clone()).await.unwrap();
    s.complete(p, &r, 0);
    let mut b = submit(&mut s, req("b", (10..30).collect(), 2, greedy()));
    let shapes = drive(&mut s, &w).await;
    // Next step: a's decode token first, then b's chunk limited by the budget (10 - 1 = 9 → 8).
    assert_eq!(shapes[0], vec![(1, LogitsMode::Last), (8, LogitsMode::None)]);
    assert_eq!(shapes[1], vec![(1, LogitsMode::Last), (8, LogitsMode::None)]);
    assert_eq!(shapes[2], vec![(1, LogitsMode::Last), (4, LogitsMode::Last)]);
    assert!(shapes.iter().all(|st| st.iter().map(|x| x.0).sum::<usize>() <= 10));
    let (ta, ..) = outcome(&mut a);
    let (tb, ..) = outcome(&mut b);
    assert_eq!(ta, reference_greedy(&w, &[1, 2, 3], 6));
    assert_eq!(tb, reference_greedy(&w, &(10..30).collect::<Vec<_>>(), 2));
}

#[tokio::test]
async fn output_is_clipped_at_the_context_length() {
    let w = world(4, 64, 16);
    let mut s = sched(&w, SchedConfig::default());
    let mut rx = submit(&mut s, req("a", (1..13).collect(), 100, greedy()));
    drive(&mut s, &w).await;
    let (toks, reason, usage, _) = outcome(&mut rx);
    assert_eq!(toks.len(), 4);
    assert_eq!(reason, Some(FinishReason::Length));
    assert_eq!(usage.completion_tokens, 4);
}

#[tokio::test]
async fn stop_token_ends_without_being_emitted() {
    let w = world(4, 64, 256);
    let prompt = vec![5, 6, 7];
    let expect = reference_greedy(&w, &prompt, 3);
    let mut s = sched(&w, SchedConfig::default());
    let mut r = req("a", prompt, 10, greedy());
    r.stop_token_ids = vec![expect[2]];
    let mut rx = submit(&mut s, r);
    drive(&mut s, &w).await;
    let (toks, reason, usage, _) = outcome(&mut rx);
    assert_eq!(toks, expect[..2].to_vec());
    assert_eq!(reason, Some(FinishReason::Stop));
    assert_eq!(usage.completion_tokens, 3);
}

#[tokio::test]
async fn cancellation_frees_pages_and_releases_on_ranks() {
    let w = world(4, 64, 256);
    let mut s = sched(&w, SchedConfig::default());
    let rx = submit(&mut s, req("a", (1..20).collect(), 50, greedy()));
    let p = s.plan().unwrap();
    let r = w.step(1, p.request.clone()).await.unwrap();
    s.complete(p, &r, 0);
    assert_eq!(s.running(), 1);
    assert!(s.kv().used_pages() > 0);
    drop(rx);
    assert_eq!(s.reap_cancelled(), 1);
    assert_eq!(s.kv().used_pages(), 0);
    let rel = s.take_releases();
    assert_eq!(rel.len(), 1);
    w.release(1, rel).await.unwrap();
    assert_eq!(w.live_sequences(), 0);
    // Its 4 full prompt pages stay reusable.
    assert_eq!(s.kv().cached_pages(), 4);
}

#[tokio::test]
async fn cache_length_disagreement_drops_only_that_sequence() {
    let w = world(4, 64, 256);
    w.set_wrong_len_token(1, 77);
    let mut s = sched(&w, SchedConfig::default());
    let mut good = submit(&mut s, req("good", vec![1, 2, 3, 4, 5], 4, greedy()));
    let mut bad = submit(&mut s, req("bad", vec![1, 77, 3], 4, greedy()));
    drive(&mut s, &w).await;
    let (tg, rg, _, eg) = outcome(&mut good);
    let (tb, rb, _, eb) = outcome(&mut bad);
    assert_eq!(eg, None);
    assert_eq!(rg, Some(FinishReason::Length));
    assert_eq!(tg, reference_greedy(&w, &[1, 2, 3, 4, 5], 4));
    assert!(tb.is_empty());
    assert_eq!(rb, None);
    match eb {
        Some(EngineError::CacheMismatch(m)) => assert!(m.contains("rank 1 reports cache length 4 (expected 3)"), "{m}"),
        other => panic!("expected CacheMismatch, got {other:?}"),
    }
    assert_eq!(w.live_sequences(), 0);
    assert_eq!(s.kv().used_pages(), 0);
}

/// A fake world of `n_pages` pages of 4 tokens (context 256) and a scheduler on it that keeps
/// two steps in flight.
fn two_in_flight(n_pages: u32, cfg: SchedConfig) -> (FakeWorld, Scheduler) {
    let w = world(4, n_pages, 256);
    let mut s = sched(&w, cfg);
    s.set_steps_in_flight(2);
    (w, s)
}

/// The memory-pressure scenario's load: three 10-token prompts, 12 greedy tokens each;
/// returns the prompts and their event receivers.
fn submit_pressure(s: &mut Scheduler) -> (Vec<Vec<u32>>, Vec<mpsc::UnboundedReceiver<GenEvent>>) {
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| (0..10).map(|t| t + 10 * i + 1).collect()).collect();
    let rxs: Vec<_> = prompts.iter().enumerate().map(|(i, p)| submit(s, req(&format!("p{i}"), p.clone(), 12, greedy()))).collect();
    (prompts, rxs)
}

/// Every generation of `submit_pressure` ended with Length and exactly the reference tokens.
fn assert_pressure_outputs(w: &FakeWorld, prompts: &[Vec<u32>], rxs: &mut [mpsc::UnboundedReceiver<GenEvent>]) {
    for (i, rx) in rxs.iter_mut().enumerate() {
        let (toks, reason, _, err) = outcome(rx);
        assert_eq!(err, None, "seq {i}");
        assert_eq!(reason, Some(FinishReason::Length));
        assert_eq!(toks, reference_greedy(w, &prompts[i], 12), "seq {i}");
    }
}

#[tokio::test]
async fn memory_pressure_preempts_and_outputs_stay_exact() {
    // 12 pages of 4 tokens = 48 slots; three sequences that each grow to 22 tokens.
    let w = world(4, 12, 256);
    let mut s = sched(&w, SchedConfig::default());
    let (prompts, mut rxs) = submit_pressure(&mut s);
    drive(&mut s, &w).await;
    assert_pressure_outputs(&w, &prompts, &mut rxs);
    assert_eq!(s.kv().used_pages(), 0);
    assert!(s.metrics.preemptions.load(std::sync::atomic::Ordering::Relaxed) > 0, "the scenario must preempt");
}

#[tokio::test]
async fn lone_sequence_that_outgrows_memory_ends_with_length() {
    let w = world(4, 4, 256); // 16 slots
    let mut s = sched(&w, SchedConfig::default());
    let mut rx = submit(&mut s, req("a", (1..11).collect(), 100, greedy()));
    drive(&mut s, &w).await;
    let (toks, reason, ..) = outcome(&mut rx);
    assert_eq!(reason, Some(FinishReason::Length));
    assert_eq!(toks.len(), 7); // 10 + 7 = 17 tokens, 16 of them in the cache
}

#[tokio::test]
async fn seeded_sampling_is_independent_of_batching() {
    let w = world(4, 64, 256);
    let sampling = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, seed: Some(1234), ..Default::default() };
    let prompt = vec![3, 1, 4, 1, 5, 9, 2, 6];
    let mut alone = sched(&w, SchedConfig::default());
    let mut rx = submit(&mut alone, req("alone", prompt.clone(), 20, sampling.clone()));
    drive(&mut alone, &w).await;
    let (solo, ..) = outcome(&mut rx);
    let mut batched = sched(&w, SchedConfig { prefill_chunk: 3, ..Default::default() });
    let mut others: Vec<_> = (0..4).map(|i| submit(&mut batched, req("o", vec![i + 40; 7], 9, SamplingParams { seed: Some(i as u64), ..Default::default() }))).collect();
    let mut rx = submit(&mut batched, req("batched", prompt.clone(), 20, sampling.clone()));
    drive(&mut batched, &w).await;
    let (with_others, ..) = outcome(&mut rx);
    assert_eq!(solo, with_others);
    assert_eq!(solo.len(), 20);
    for o in others.iter_mut() {
        assert_eq!(outcome(o).1, Some(FinishReason::Length));
    }
    // A different seed: a different continuation.
    let mut other = sched(&w, SchedConfig::default());
    let mut rx = submit(&mut other, req("x", prompt, 20, SamplingParams { seed: Some(99), ..sampling }));
    drive(&mut other, &w).await;
    assert_ne!(outcome(&mut rx).0, solo);
}

#[tokio::test]
async fn scoring_matches_the_model_and_leaves_the_prefix_cache_alone() {
    let w = world(4, 16, 256);
    let mut s = sched(&w, SchedConfig { prefill_chunk: 5, ..Default::default() });
    // Fill the cache with a generation's pages.
    let mut rx = submit(&mut s, req("g", (1..14).collect(), 1, greedy()));
    drive(&mut s, &w).await;
    outcome(&mut rx);
    let cached_before = s.kv().cached_pages();
    let lookups_before = s.kv().stats();
    // Score the same tokens (would hit the cache if scoring used it) plus a tail.
    let tokens: Vec<u32> = (1..20).collect();
    let (tx, mut orx) = oneshot::channel();
    s.submit(Seq::score("s".into(), tokens.clone(), tx));
    drive(&mut s, &w).await;
    let res = orx.try_recv().unwrap().unwrap();
    assert_eq!(res.logprobs.len(), tokens.len() - 1);
    assert_eq!(res.cached_tokens, 0);
    for i in 1..tokens.len() {
        let l = w.logits(&tokens[..i]);
        let lse = minimax_shared::sampling::logsumexp(&l);
        assert!((res.logprobs[i - 1] - (l[tokens[i] as usize] - lse)).abs() < 1e-4);
    }
    assert_eq!(s.kv().cached_pages(), cached_before);
    assert_eq!(s.kv().stats(), lookups_before);
    assert_eq!(s.kv().used_pages(), 0);
}

#[test]
fn validation_limits() {
    assert!(matches!(validate(0, 16, 64, false), Err(EngineError::InvalidRequest(_))));
    assert_eq!(validate(16, 16, 64, false), Err(EngineError::PromptTooLong { prompt: 16, context: 16 }));
    assert_eq!(validate(15, 16, 64, false), Ok(()));
    assert_eq!(validate(16, 16, 64, true), Ok(()));
    assert_eq!(validate(40, 100, 32, false), Err(EngineError::PromptTooLong { prompt: 40, context: 32 }));
}

/// Pages a plan's entries write (from their expected length to their new end).
fn written_pages(plan: &Plan, page_size: usize) -> Vec<u32> {
    let mut out = vec![];
    for q in &plan.request.seqs {
        let (from, to) = (q.expected_cache_len as usize, q.expected_cache_len as usize + q.tokens.len());
        out.extend_from_slice(&q.page_table[from / page_size..to.div_ceil(page_size)]);
    }
    out
}

/// Keeps `depth` plans in flight and completes them newest first (out of order), until idle.
async fn drive_in_flight(s: &mut Scheduler, w: &FakeWorld, depth: usize) -> usize {
    let mut most = 0;
    let mut flight: Vec<(Plan, Vec<StepResponse>)> = vec![];
    for _ in 0..10_000 {
        s.reap_cancelled();
        flush_releases(s, w).await;
        while flight.len() < depth {
            let Some(plan) = s.plan() else { break };
            // Disjoint from every plan in flight: no sequence, no written page in common.
            for (other, _) in &flight {
                for q in &plan.request.seqs {
                    assert!(other.request.seqs.iter().all(|o| o.seq_id != q.seq_id), "sequence {} planned twice", q.seq_id);
                }
                let mine = written_pages(&plan, 4);
                assert!(written_pages(other, 4).iter().all(|p| !mine.contains(p)), "a page written by two steps in flight");
            }
            let resp = w.step(1, plan.request.clone()).await.unwrap();
            flight.push((plan, resp));
        }
        most = most.max(flight.len());
        let Some((plan, resp)) = flight.pop() else { break };
        s.complete(plan, &resp, 0);
        s.kv().check_invariants();
    }
    assert!(s.is_idle(), "scheduler did not drain");
    assert_eq!(s.in_flight(), 0);
    most
}

#[tokio::test]
async fn steps_in_flight_take_disjoint_groups_and_give_the_same_tokens() {
    let (w, mut s) = two_in_flight(64, SchedConfig { prefill_chunk: 5, ..Default::default() });
    let prompts: Vec<Vec<u32>> = (0..5u32).map(|i| (1..8 + i).map(|t| t * (i + 3) % 90 + 1).collect()).collect();
    let mut rxs: Vec<_> = prompts.iter().enumerate().map(|(i, p)| submit(&mut s, req(&format!("r{i}"), p.clone(), 6, greedy()))).collect();
    // Five sequences, two steps in flight: the first takes three, the second the other two,
    // and a third plan has nobody left to run.
    let p1 = s.plan().unwrap();
    let p2 = s.plan().unwrap();
    assert_eq!((p1.n_seqs(), p2.n_seqs()), (3, 2));
    assert!(s.plan().is_none(), "every running sequence is in flight");
    assert_eq!(s.in_flight(), 5);
    // The second completes first; its sequences are planned again, the first's are not.
    let r2 = w.step(1, p2.request.clone()).await.unwrap();
    let ids2: Vec<u64> = p2.request.seqs.iter().map(|q| q.seq_id).collect();
    s.complete(p2, &r2, 0);
    let p3 = s.plan().unwrap();
    assert!(p3.request.seqs.iter().all(|q| ids2.contains(&q.seq_id)), "{:?}", p3.request);
    let r1 = w.step(1, p1.request.clone()).await.unwrap();
    s.complete(p1, &r1, 0);
    let r3 = w.step(1, p3.request.clone()).await.unwrap();
    s.complete(p3, &r3, 0);
    let most = drive_in_flight(&mut s, &w, 2).await;
    assert_eq!(most, 2);
    for (i, rx) in rxs.iter_mut().enumerate() {
        let (toks, reason, _, err) = outcome(rx);
        assert_eq!(err, None);
        assert_eq!(reason, Some(FinishReason::Length));
        assert_eq!(toks, reference_greedy(&w, &prompts[i], 6), "request {i}");
    }
}

#[tokio::test]
async fn a_cancelled_sequence_in_flight_keeps_its_pages_until_its_step_completes() {
    let (w, mut s) = two_in_flight(64, SchedConfig::default());
    let mut keep = submit(&mut s, req("keep", (1..10).collect(), 4, greedy()));
    let gone = submit(&mut s, req("gone", (20..30).collect(), 4, greedy()));
    let p1 = s.plan().unwrap();
    let p2 = s.plan().unwrap();
    assert_eq!((p1.n_seqs(), p2.n_seqs()), (1, 1));
    drop(gone);
    // Its step still writes its pages: nothing is reaped or released yet.
    let used = s.kv().used_pages();
    assert_eq!(s.reap_cancelled(), 0);
    assert!(s.take_releases().is_empty());
    assert_eq!(s.kv().used_pages(), used);
    for p in [p2, p1] {
        let r = w.step(1, p.request.clone()).await.unwrap();
        s.complete(p, &r, 0);
    }
    assert_eq!(s.reap_cancelled(), 1);
    assert_eq!(s.take_releases().len(), 1);
    drive_in_flight(&mut s, &w, 2).await;
    let (toks, reason, _, err) = outcome(&mut keep);
    assert_eq!((err, reason), (None, Some(FinishReason::Length)));
    assert_eq!(toks, reference_greedy(&w, &(1..10).collect::<Vec<_>>(), 4));
}

#[tokio::test]
async fn a_refused_plan_fails_only_its_sequences() {
    let (w, mut s) = two_in_flight(64, SchedConfig::default());
    let mut a = submit(&mut s, req("a", (1..10).collect(), 3, greedy()));
    let mut b = submit(&mut s, req("b", (20..30).collect(), 3, greedy()));
    let pa = s.plan().unwrap();
    let pb = s.plan().unwrap();
    s.fail_plan(pa, EngineError::Internal("refused".into()));
    assert_eq!(s.in_flight(), 1);
    assert_eq!(s.running(), 1);
    assert_eq!(s.take_releases().len(), 1);
    let r = w.step(1, pb.request.clone()).await.unwrap();
    s.complete(pb, &r, 0);
    drive_in_flight(&mut s, &w, 2).await;
    assert_eq!(outcome(&mut a).3, Some(EngineError::Internal("refused".into())));
    let (toks, reason, _, err) = outcome(&mut b);
    assert_eq!((err, reason), (None, Some(FinishReason::Length)));
    assert_eq!(toks, reference_greedy(&w, &(20..30).collect::<Vec<_>>(), 3));
    assert_eq!(s.kv().used_pages(), 0);
}

#[tokio::test]
async fn one_step_in_flight_plans_every_running_sequence() {
    let w = world(4, 64, 256);
    let mut s = sched(&w, SchedConfig::default());
    let _rxs: Vec<_> = (0..5u32).map(|i| submit(&mut s, req(&format!("r{i}"), vec![i + 1; 5], 2, greedy()))).collect();
    assert_eq!(s.plan().unwrap().n_seqs(), 5);
    assert_eq!(SchedConfig::default().steps_in_flight("pipeline", 3), 3);
    assert_eq!(SchedConfig { pipeline_inflight: 2, ..Default::default() }.steps_in_flight("pipeline", 4), 2);
    assert_eq!(SchedConfig::default().steps_in_flight("tensor", 4), 1);
    // One rank: overlapped decode keeps two in flight unless it is off.
    assert_eq!(SchedConfig::default().steps_in_flight("tensor", 1), 2);
    assert_eq!(SchedConfig { overlap: false, ..Default::default() }.steps_in_flight("pipeline", 1), 1);
}

#[tokio::test]
async fn memory_pressure_with_steps_in_flight_never_touches_a_sequence_in_flight() {
    // The memory-pressure scenario above with two steps in flight (completed newest first):
    // preemption only picks sequences outside every step in flight, outputs stay exact.
    let (w, mut s) = two_in_flight(12, SchedConfig::default());
    let (prompts, mut rxs) = submit_pressure(&mut s);
    drive_in_flight(&mut s, &w, 2).await;
    assert_pressure_outputs(&w, &prompts, &mut rxs);
    assert_eq!(s.kv().used_pages(), 0);
    // A lone sequence that outgrows memory still ends with Length.
    let mut rx = submit(&mut s, req("a", (1..11).collect(), 100, greedy()));
    drive_in_flight(&mut s, &w, 2).await;
    let (toks, reason, ..) = outcome(&mut rx);
    assert_eq!(reason, Some(FinishReason::Length));
    assert!(!toks.is_empty());
}

/// A one-rank fake world and an overlapping scheduler on it.
fn overlapped(n_pages: u32, context: u32, on: bool) -> (FakeWorld, Scheduler) {
    let w = FakeWorld::new(FakeConfig { page_size: 4, n_pages, context, world_size: 1, ..Default::default() });
    let mut s = sched(&w, SchedConfig::default());
    s.set_overlap(on);
    s.set_late_rules(on);
    (w, s)
}

/// Runs an overlapping scheduler as the engine does on one rank: up to two steps in flight,
/// each chained to the one sent before it, computed concurrently as a rank would (a row whose
/// rule follows waits for it), the answers applied oldest first. Returns how many entries fed
/// a drawn token and how many late rules the steps carried.
async fn drive_overlapped(s: &mut Scheduler, w: &FakeWorld) -> (usize, usize) {
    use futures_util::StreamExt;
    type Flight<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = (Plan, Vec<StepResponse>)> + 'a>>;
    let (mut fed, mut rules) = (0, 0);
    let mut flight: futures_util::stream::FuturesOrdered<Flight<'_>> = Default::default();
    let mut last_sent = 0;
    for _ in 0..10_000 {
        s.reap_cancelled();
        flush_releases(s, w).await;
        while flight.len() < 2 {
            let Some(mut plan) = s.plan() else { break };
            plan.request.after_step_id = if flight.is_empty() { 0 } else { last_sent };
            last_sent = plan.request.step_id;
            fed += plan.request.seqs.iter().filter(|q| q.feed_drawn).count();
            rules += plan.request.late_rules.len();
            let req = plan.request.clone();
            flight.push_back(Box::pin(async move { (plan, w.step(1, req).await.unwrap()) }));
        }
        let Some((plan, resp)) = flight.next().await else { break };
        s.complete(plan, &resp, 0);
        flush_releases(s, w).await;
        s.kv().check_invariants();
    }
    assert!(s.is_idle(), "scheduler did not drain");
    assert_eq!(s.in_flight(), 0);
    (fed, rules)
}

/// Greedy, seeded sampling with penalties (the rank adds each fed token to the history),
/// logprobs, stop tokens, max_tokens and the context limit.
fn overlap_requests(stop: Vec<u32>) -> Vec<GenerationRequest> {
    let sampled = |seed: u64| SamplingParams { temperature: 0.9, top_k: 20, seed: Some(seed), frequency_penalty: 0.7, presence_penalty: 0.4, repetition_penalty: 1.3, ..Default::default() };
    let mut v = vec![
        req("greedy", vec![5, 6, 7, 8, 9], 17, greedy()),
        req("sampled", vec![3, 1, 4, 1, 5, 9, 2, 6], 25, sampled(7)),
        req("short", vec![11, 12], 1, sampled(8)),
        req("two", vec![13, 14, 15], 2, greedy()),
        req("long-prompt", (20..40).collect(), 30, sampled(9)),
        req("context", (50..80).collect(), 100, greedy()),
    ];
    v[1].sampling.logprobs = true;
    v[1].sampling.top_logprobs = 3;
    v[0].stop_token_ids = stop;
    v
}

#[tokio::test]
async fn overlapped_decode_gives_the_tokens_of_one_step_at_a_time() {
    // A stop token the greedy request meets at its fourth output token.
    let (w, mut s) = overlapped(64, 40, false);
    let mut rx = submit(&mut s, overlap_requests(vec![]).remove(0));
    drive(&mut s, &w).await;
    let stop = outcome(&mut rx).0[3];
    let mut runs = vec![];
    for on in [false, true] {
        let (w, mut s) = overlapped(64, 40, on);
        let mut rxs: Vec<_> = overlap_requests(vec![stop]).into_iter().map(|r| submit(&mut s, r)).collect();
        let fed = if on {
            drive_overlapped(&mut s, &w).await.0
        } else {
            drive(&mut s, &w).await;
            0
        };
        assert_eq!(fed > 0, on, "overlap {on}: {fed} entries fed a drawn token");
        // Nothing leaks: no page held, no sequence left on the rank.
        assert_eq!(s.kv().used_pages(), 0);
        assert_eq!(w.live_sequences(), 0);
        let outs: Vec<_> = rxs.iter_mut().map(outcome).collect();
        runs.push(outs);
    }
    let (off, on) = (&runs[0], &runs[1]);
    for (i, (a, b)) in off.iter().zip(on).enumerate() {
        assert_eq!(a.3, None, "request {i}");
        assert_eq!(b.3, None, "request {i}");
        assert_eq!(a.0, b.0, "request {i}: tokens");
        assert_eq!(a.1, b.1, "request {i}: finish reason");
        assert_eq!(a.2.completion_tokens, b.2.completion_tokens, "request {i}: usage");
    }
    assert_eq!(off[0].1, Some(FinishReason::Stop));
    assert_eq!(off[0].0.len(), 3);
    assert_eq!(off[2].0.len(), 1);
    assert_eq!(off[3].0.len(), 2);
    // 30 prompt tokens in a 40-token context: 10 more at most.
    assert_eq!((off[5].0.len(), off[5].1), (10, Some(FinishReason::Length)));
    assert_eq!(off[1].0.len(), 25);
}

#[tokio::test]
async fn an_overlapped_sequence_whose_client_left_drains_and_is_released() {
    let (w, mut s) = overlapped(64, 256, true);
    let rx = submit(&mut s, req("a", (1..10).collect(), 1000, greedy()));
    let mut keep = submit(&mut s, req("b", (30..40).collect(), 12, greedy()));
    // Two steps in flight: the prefill, then the first overlapped decode step.
    let p1 = s.plan().unwrap();
    let r1 = w.step(1, p1.request.clone()).await.unwrap();
    let p2 = s.plan().unwrap();
    assert!(p2.request.seqs.iter().all(|q| q.feed_drawn && q.tokens.is_empty()));
    let r2 = w.step(1, p2.request.clone()).await.unwrap();
    assert!(s.plan().is_none(), "two steps in flight hold every sequence");
    s.complete(p1, &r1, 0);
    drop(rx);
    // In flight: not reaped yet, and not planned again.
    assert_eq!(s.reap_cancelled(), 0);
    let p3 = s.plan().unwrap();
    assert_eq!(p3.n_seqs(), 1);
    let r3 = w.step(1, p3.request.clone()).await.unwrap();
    s.complete(p2, &r2, 0);
    assert_eq!(s.reap_cancelled(), 1);
    assert_eq!(s.take_releases().len(), 1);
    s.complete(p3, &r3, 0);
    drive_overlapped(&mut s, &w).await;
    let (toks, reason, ..) = outcome(&mut keep);
    assert_eq!((toks, reason), (reference_greedy(&w, &(30..40).collect::<Vec<_>>(), 12), Some(FinishReason::Length)));
    assert_eq!(s.kv().used_pages(), 0);
}

#[tokio::test]
async fn an_overlapped_entry_after_a_stop_is_dropped_and_its_pages_wait_for_it() {
    let (w, mut s) = overlapped(64, 256, true);
    let prompt: Vec<u32> = (1..8).collect();
    let first = reference_greedy(&w, &prompt, 1)[0];
    let mut r = req("a", prompt, 50, greedy());
    r.stop_token_ids = vec![first];
    let mut rx = submit(&mut s, r);
    let p1 = s.plan().unwrap();
    let r1 = w.step(1, p1.request.clone()).await.unwrap();
    let p2 = s.plan().unwrap();
    let r2 = w.step(1, p2.request.clone()).await.unwrap();
    // The first token is the stop: the request ends, but step 2 still holds its pages.
    s.complete(p1, &r1, 0);
    let (toks, reason, ..) = outcome(&mut rx);
    assert_eq!((toks.len(), reason), (0, Some(FinishReason::Stop)));
    assert!(s.kv().used_pages() > 0);
    assert!(s.take_releases().is_empty());
    s.complete(p2, &r2, 0);
    assert_eq!(s.kv().used_pages(), 0);
    assert_eq!(s.take_releases().len(), 1);
    assert!(s.is_idle());
}

/// A structured output on the fake world's 97-token vocabulary (token `t < 95` is the byte
/// `0x20 + t`, token 96 ends generation).
fn constrained_request(seed: u64) -> GenerationRequest {
    use crate::constrain::ConstraintSpec;
    use crate::constrain::schema::Grammar;
    use crate::constrain::vocab::TokenIndex;
    let items = (0..95u32).map(|t| (t, vec![0x20 + t as u8])).collect();
    let index = Arc::new(TokenIndex::from_tokens(97, items, vec![96]));
    let schema = serde_json::json!({"type": "object", "properties": {"a": {"enum": ["x", "yz"]}, "b": {"type": "boolean"}}, "required": ["a", "b"], "additionalProperties": false});
    let spec = ConstraintSpec { grammar: Grammar::from_schema(&schema).unwrap(), index, reasoning: None, starts_in_reasoning: false, mode: crate::constrain::Mode::Document };
    let sampling = SamplingParams { temperature: 0.9, top_k: 20, seed: Some(seed), constraint: Some(Arc::new(spec)), ..Default::default() };
    GenerationRequest { stop_token_ids: vec![96], ..req("json", vec![3, 1, 4], 1000, sampling) }
}

/// Constrained sequences in overlapped decode: with late rules each step after the first is
/// fed from the rank's draw and its rule follows with the next step; without, each waits for
/// its token. Either way the tokens are those of one step at a time, and valid.
#[tokio::test]
async fn constrained_outputs_are_valid_and_fed_with_their_rules_following() {
    let mut runs = vec![];
    for (on, late) in [(false, false), (true, false), (true, true)] {
        let (w, mut s) = overlapped(256, 2048, on);
        s.set_late_rules(late);
        let mut rxs: Vec<_> = (0..3).map(|seed| submit(&mut s, constrained_request(seed))).collect();
        let (fed, rules) = if on { drive_overlapped(&mut s, &w).await } else { drive(&mut s, &w).await; (0, 0) };
        runs.push(rxs.iter_mut().map(outcome).collect::<Vec<_>>());
        let tokens: usize = runs.last().unwrap().iter().map(|o| o.0.len()).sum();
        if late {
            // Every token but each sequence's first and last is fed (the last one's entry is
            // dropped after the stop), and every fed row gets its rule.
            assert!(fed >= tokens - 2 * 3, "fed {fed} of {tokens}");
            assert_eq!(rules, fed, "one rule for each row sent with its rule to follow");
        } else {
            assert_eq!((fed, rules), (0, 0), "a constrained sequence's next mask needs the token drawn");
        }
    }
    assert_eq!(runs[0], runs[1]);
    assert_eq!(runs[0], runs[2]);
    for (toks, reason, _, err) in &runs[0] {
        assert_eq!((reason, err), (&Some(FinishReason::Stop), &None));
        let text: String = toks.iter().map(|&t| char::from(0x20 + t as u8)).collect();
        let doc: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(doc["a"] == "x" || doc["a"] == "yz", "{text}");
        assert!(doc["b"].is_boolean() && doc.as_object().unwrap().len() == 2, "{text}");
    }
}

/// A constrained sequence dropped while a step in flight waits for its rule (a rank reports
/// the wrong cache length for every step that feeds the quote token, the second token of each
/// document): the waiting row still gets a rule (an empty one, with nothing else to run: a
/// step of rules alone), so the fake rank, which waits for it as a rank does, finishes that
/// step and the scheduler drains. Without the rule the fake gives up after 10 s (a panic).
#[tokio::test]
async fn a_constrained_sequence_dropped_while_it_owes_a_rule_still_sends_it() {
    let (w, mut s) = overlapped(256, 2048, true);
    // Token 2 is the byte '"' (the fake vocabulary of `constrained_request`).
    w.set_wrong_len_token(0, 2);
    let mut rxs: Vec<_> = (0..3).map(|seed| submit(&mut s, constrained_request(seed))).collect();
    let (fed, rules) = drive_overlapped(&mut s, &w).await;
    assert!(fed > 0 && rules > 0, "fed {fed}, rules {rules}");
    for rx in rxs.iter_mut() {
        let (toks, _, _, err) = outcome(rx);
        assert!(matches!(err, Some(EngineError::CacheMismatch(_))), "{toks:?} {err:?}");
    }
    assert_eq!(s.kv().used_pages(), 0);
}
