use super::*;
use std::sync::Arc;

fn row(ids: &[u32], logits: &[f32]) -> RowOutput {
    let lse = logits.iter().map(|&l| (l as f64).exp()).sum::<f64>().ln() as f32;
    RowOutput {
        position: 0,
        candidate_ids: ids.to_vec(),
        candidate_logits: logits.to_vec(),
        candidate_raw_logits: logits.to_vec(),
        raw_logsumexp: lse,
        top_ids: ids.to_vec(),
        top_logprobs: logits.iter().map(|&l| l - lse).collect(),
        target_logprob: 0.0,
        drawn_token: None,
    }
}

/// One sampled step: the next uniform number, then the draw with it.
fn take(s: &mut Sampler, r: &RowOutput) -> Result<Sampled, SampleError> {
    let u = s.next_draw();
    s.sample(r, u)
}

fn params(temperature: f32, seed: u64) -> SamplingParams {
    SamplingParams { temperature, seed: Some(seed), ..Default::default() }
}

#[test]
fn greedy_takes_the_best_candidate_lowest_id_on_ties() {
    let mut s = Sampler::new(params(0.0, 1));
    assert_eq!(take(&mut s, &row(&[5, 9, 2], &[1.0, 3.0, 2.0])).unwrap().token, 9);
    assert_eq!(take(&mut s, &row(&[7, 3], &[1.0, 1.0])).unwrap().token, 3);
}

#[test]
fn same_seed_same_tokens_whatever_the_candidate_order() {
    let ids = [10u32, 11, 12, 13, 14];
    let logits = [0.5f32, 0.1, 0.3, 0.2, 0.4];
    let mut a = Sampler::new(params(1.0, 42));
    let mut b = Sampler::new(params(1.0, 42));
    let (mut rid, mut rl) = (ids.to_vec(), logits.to_vec());
    rid.reverse();
    rl.reverse();
    let ta: Vec<u32> = (0..64).map(|_| take(&mut a, &row(&ids, &logits)).unwrap().token).collect();
    let tb: Vec<u32> = (0..64).map(|_| take(&mut b, &row(&rid, &rl)).unwrap().token).collect();
    assert_eq!(ta, tb);
    // A different seed gives a different stream (with overwhelming probability).
    let mut c = Sampler::new(params(1.0, 43));
    let tc: Vec<u32> = (0..64).map(|_| take(&mut c, &row(&ids, &logits)).unwrap().token).collect();
    assert_ne!(ta, tc);
}

#[test]
fn draws_follow_the_softmax() {
    let mut s = Sampler::new(params(1.0, 7));
    let logits = [0.0f32, (3.0f32).ln()]; // p = 0.25, 0.75
    let n = 20000;
    let ones = (0..n).filter(|_| take(&mut s, &row(&[0, 1], &logits)).unwrap().token == 1).count();
    let f = ones as f64 / n as f64;
    assert!((f - 0.75).abs() < 0.02, "frequency {f}");
}

#[test]
fn logprobs_use_raw_logits_and_top_list() {
    let mut p = params(0.0, 1);
    p.logprobs = true;
    p.top_logprobs = 2;
    let mut s = Sampler::new(p);
    let r = row(&[1, 2, 3], &[2.0, 1.0, 0.0]);
    let out = take(&mut s, &r).unwrap();
    let lp = out.logprob.unwrap();
    assert!((lp.logprob - (2.0 - r.raw_logsumexp)).abs() < 1e-6);
    assert_eq!(lp.top.len(), 2);
    assert_eq!(lp.top[0].0, 1);
}

#[test]
fn spec_carries_history_and_bias_sorted() {
    let mut p = params(0.7, 1);
    p.logit_bias.insert(9, -1.0);
    p.logit_bias.insert(3, 2.0);
    let mut s = Sampler::new(p);
    s.observe(5);
    s.observe(5);
    s.observe(1);
    let spec = s.spec(0.25);
    assert_eq!(spec.draw, Some(0.25));
    assert_eq!(spec.logit_bias.iter().map(|b| b.token).collect::<Vec<_>>(), vec![3, 9]);
    assert_eq!(spec.history.iter().map(|c| (c.token, c.count)).collect::<Vec<_>>(), vec![(1, 1), (5, 2)]);
    assert_eq!(spec.top_logprobs, 0);
}

#[test]
fn contract_breaches_are_errors() {
    let mut s = Sampler::new(params(1.0, 1));
    assert_eq!(take(&mut s, &row(&[], &[])), Err(SampleError::Draw(DrawError::NoCandidates)));
    let mut r = row(&[1, 2], &[0.0, 1.0]);
    r.candidate_logits.pop();
    assert!(matches!(take(&mut s, &r), Err(SampleError::Draw(DrawError::Ragged { .. }))));
    let mut r = row(&[1, 2], &[0.0, 1.0]);
    r.candidate_raw_logits.pop();
    assert!(matches!(take(&mut s, &r), Err(SampleError::RaggedRaw { .. })));
}

#[test]
fn the_ranks_draw_is_checked_against_the_same_uniform() {
    let mut s = Sampler::new(params(1.0, 3));
    let mut r = row(&[4, 6], &[0.0, (3.0f32).ln()]); // id 6 holds [0, 0.75)
    r.drawn_token = Some(6);
    assert_eq!(s.sample(&r, 0.5).unwrap().token, 6);
    r.drawn_token = Some(4);
    assert_eq!(s.sample(&r, 0.5), Err(SampleError::DrawMismatch { rank: 4, gateway: 6 }));
    assert_eq!(s.sample(&r, 0.9).unwrap().token, 4);
}

#[test]
fn constrained_specs_ban_the_end_in_reasoning_then_carry_the_mask() {
    use crate::constrain::ConstraintSpec;
    use crate::constrain::schema::Grammar;
    use crate::constrain::vocab::TokenIndex;
    // Tokens 0..=9: "0".."9"; 10: "</think>"; 11: end of generation.
    let mut items: Vec<(u32, Vec<u8>)> = (0..10u32).map(|t| (t, vec![b'0' + t as u8])).collect();
    items.push((10, b"</think>".to_vec()));
    let index = Arc::new(TokenIndex::from_tokens(12, items, vec![11]));
    let spec = ConstraintSpec { grammar: Grammar::from_schema(&serde_json::json!({"enum": [42]})).unwrap(), index, reasoning: Some((b"<think>".to_vec(), b"</think>".to_vec())), starts_in_reasoning: true, mode: crate::constrain::Mode::Document };
    let mut p = params(1.0, 3);
    p.logit_bias.insert(11, 5.0);
    p.constraint = Some(Arc::new(spec));
    let mut s = Sampler::new(p);
    assert!(s.needs_drawn_token());
    let (spec, _) = s.next_spec();
    assert_eq!(spec.allowed_tokens, None);
    assert_eq!(spec.logit_bias.iter().find(|b| b.token == 11).map(|b| b.bias), Some(f32::NEG_INFINITY), "the end is banned, over the request's own bias");
    take(&mut s, &row(&[10], &[0.0])).unwrap();
    let (spec, _) = s.next_spec();
    // Only "4" may start the document: bit 4 of the 2-byte mask.
    assert_eq!(spec.allowed_tokens, Some(vec![0b0001_0000, 0]));
    assert!(matches!(take(&mut s, &row(&[5], &[0.0])), Err(SampleError::Constraint(_))), "a token outside the mask is an error");
    take(&mut s, &row(&[4], &[0.0])).unwrap();
    take(&mut s, &row(&[2], &[0.0])).unwrap();
    assert_eq!(s.next_spec().0.allowed_tokens, Some(vec![0, 0b0000_1000]), "then only the end");
}
