//! Row reduction for sampling: turns one row of raw logits into the few numbers the gateway
//! needs, so no full-vocabulary vector crosses gRPC per token while sampling stays *exactly*
//! equal to sampling from the full processed distribution.
//!
//! This is pure CPU code and the reference for a CUDA twin: any other implementation must
//! produce the same candidate set (same ids, same order) and the same values.
//!
//! # Order of operations (as vLLM / llama.cpp apply them)
//!
//! Starting from the raw logits `z` of one row:
//!
//! 1. **Penalties**, for every token `t` of the history with count `c > 0`:
//!    - repetition (`r != 1`): `z[t] = z[t] / r` if `z[t] > 0`, else `z[t] * r`;
//!    - frequency and presence: `z[t] -= frequency * c + presence`.
//! 2. **Logit bias**: `z[t] += bias[t]` (a bias of `-inf` bans a token); then, with an
//!    allowed-token mask (structured outputs), `z[t] = -inf` for every token outside it.
//! 3. **Temperature**: `0` is greedy: the candidate set is the single argmax of the penalised
//!    logits (ties → lowest id) with sampling logit `0`. Otherwise `z /= temperature`.
//! 4. **Candidate order**: tokens with a finite logit, sorted by logit descending, ties by id
//!    ascending. Every cut below keeps a prefix of this order, so the result is deterministic.
//! 5. **top_k** (`0` = off): keep the first `k`.
//! 6. **top_p** (`>= 1` or `<= 0` = off): softmax over the kept tokens (in f64, with
//!    [`exp::det_exp`], summed in candidate order); keep the
//!    smallest prefix whose cumulative probability is `>= top_p` (at least one token).
//! 7. **min_p** (`0` = off): keep tokens with `p >= min_p * p_max`, i.e.
//!    `z - z_max >= ln(min_p)` (again a prefix).
//!
//! The gateway samples among the candidates with `softmax(candidate_logits)`; tokens outside
//! the set have probability zero in the processed distribution, so this is exact. With
//! `top_k = 0`, `top_p = 1`, `min_p = 0`, temperature 1 and no penalties or bias, the
//! candidates are the whole vocabulary with their raw logits (tests use this to compare full
//! logits).
//!
//! Alongside, and independent of the sampling parameters: the candidates' raw logits, the raw
//! log-sum-exp (so `raw - lse` is a raw logprob), the `top_logprobs` highest raw logprobs
//! (ties → lowest id) and, for scoring, the raw logprob of a given target token.

use std::cmp::Ordering;

pub mod draw;
pub mod exp;
pub mod partial;

use exp::det_exp;

/// Sampling parameters of one sequence, as the gateway asks the head rank to apply them.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingSpec {
    /// `0` = greedy.
    pub temperature: f32,
    /// `0` = off.
    pub top_k: u32,
    /// `>= 1` (or `<= 0`) = off.
    pub top_p: f32,
    /// `0` = off.
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// `1` = off.
    pub repetition_penalty: f32,
    /// Added to the logits of the given tokens.
    pub logit_bias: Vec<(u32, f32)>,
    /// Tokens generated so far with their counts (penalties apply to these).
    pub history: Vec<(u32, u32)>,
    /// How many top raw alternatives to return (0..=20).
    pub top_logprobs: u32,
    /// Structured outputs: the tokens the row may take (bit `t % 8` of byte `t / 8`; tokens
    /// past the mask are not allowed, bits past the vocabulary are ignored); every other token
    /// is removed with the logit bias (step 2). `None`: every token.
    pub allowed: Option<std::sync::Arc<[u8]>>,
}

impl Default for SamplingSpec {
    /// Plain sampling from the full distribution: temperature 1, no filtering, no penalties.
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            history: Vec::new(),
            top_logprobs: 0,
            allowed: None,
        }
    }
}

/// The reduction of one row: everything sampling and logprobs need.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct RowReduction {
    /// Candidate tokens, in candidate order (final logit descending, ties by id).
    pub candidate_ids: Vec<u32>,
    /// Their final sampling logits (after penalties, bias and temperature).
    pub candidate_logits: Vec<f32>,
    /// Their raw model logits.
    pub candidate_raw_logits: Vec<f32>,
    /// `ln Σ exp(raw)` over the whole vocabulary.
    pub raw_logsumexp: f32,
    /// The `top_logprobs` highest raw logprobs (descending, ties by id).
    pub top_ids: Vec<u32>,
    pub top_logprobs: Vec<f32>,
    /// `ln p_raw(target)` when a target was given.
    pub target_logprob: Option<f32>,
}

/// Why a row cannot be reduced.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SamplingError {
    #[error("empty logits row")]
    Empty,
    #[error("logit of token {0} is NaN")]
    NaN(u32),
    #[error("token {token} is outside the vocabulary ({vocab})")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("invalid sampling parameter: {0}")]
    Invalid(String),
    #[error("every token has probability zero after penalties and logit bias")]
    NoCandidates,
}

/// Maximum `top_logprobs` (the OpenAI API's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// `ln Σ exp(x)` computed stably in f64.
pub fn logsumexp(x: &[f32]) -> f32 {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        return m;
    }
    let s: f64 = x.iter().map(|&v| ((v - m) as f64).exp()).sum();
    (m as f64 + s.ln()) as f32
}

/// Descending by value, ties by ascending id: the one order every cut is a prefix of.
fn by_logit_desc(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.partial_cmp(&a.1).unwrap_or(Ordering::Equal).then(a.0.cmp(&b.0))
}

/// The `n` largest of `items` in candidate order (partial selection, then a sort of `n`).
fn top_n(mut items: Vec<(u32, f32)>, n: usize) -> Vec<(u32, f32)> {
    if n < items.len() {
        if n == 0 {
            return Vec::new();
        }
        items.select_nth_unstable_by(n - 1, by_logit_desc);
        items.truncate(n);
    }
    items.sort_unstable_by(by_logit_desc);
    items
}

impl SamplingSpec {
    /// Checks the parameters' ranges.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let bad = |m: String| Err(SamplingError::Invalid(m));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(format!("temperature {} (must be >= 0)", self.temperature));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p {} (must be in [0, 1])", self.min_p));
        }
        if self.top_p.is_nan() {
            return bad("top_p is NaN".into());
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(format!("repetition_penalty {} (must be > 0)", self.repetition_penalty));
        }
        if !self.presence_penalty.is_finite() || !self.frequency_penalty.is_finite() {
            return bad("presence/frequency penalty must be finite".into());
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return bad(format!("top_logprobs {} (at most {MAX_TOP_LOGPROBS})", self.top_logprobs));
        }
        if self.logit_bias.iter().any(|&(_, b)| b.is_nan() || b == f32::INFINITY) {
            return bad("logit_bias must not be NaN or +inf".into());
        }
        Ok(())
    }

    /// Applies penalties and logit bias (steps 1-2) to a copy of `raw`.
    pub fn penalised(&self, raw: &[f32]) -> Result<Vec<f32>, SamplingError> {
        let vocab = raw.len();
        let check = |t: u32| {
            if (t as usize) < vocab { Ok(t as usize) } else { Err(SamplingError::TokenOutOfRange { token: t, vocab }) }
        };
        let mut z = raw.to_vec();
        for &(t, c) in &self.history {
            let t = check(t)?;
            if c == 0 {
                continue;
            }
            if self.repetition_penalty != 1.0 {
                z[t] = if z[t] > 0.0 { z[t] / self.repetition_penalty } else { z[t] * self.repetition_penalty };
            }
            z[t] -= self.frequency_penalty * c as f32 + self.presence_penalty;
        }
        for &(t, b) in &self.logit_bias {
            let t = check(t)?;
            z[t] += b;
        }
        if let Some(m) = &self.allowed {
            // Tokens past the mask are banned (a tokenizer shorter than the logits row has no
            // text for them); bits past the vocabulary are ignored.
            for (t, v) in z.iter_mut().enumerate() {
                if m.get(t / 8).is_none_or(|byte| byte >> (t % 8) & 1 == 0) {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        Ok(z)
    }
}

/// How many leading candidates of a set the top_p and min_p cuts keep (steps 6-7), the set
/// given as its `n >= 1` final logits in candidate order (`v(0)` the largest). The one
/// definition `reduce_row`, `partial::finish` and the device's draw (`draw::draw_leading`)
/// share: weights `det_exp((v - v(0)) as f64)` (an f32 difference), summed in order.
pub(crate) fn keep_after_cuts(n: usize, v: impl Fn(usize) -> f32, spec: &SamplingSpec) -> usize {
    let zmax = v(0);
    let mut keep = n;
    if spec.top_p > 0.0 && spec.top_p < 1.0 {
        let w: Vec<f64> = (0..n).map(|i| det_exp((v(i) - zmax) as f64)).collect();
        let mut total = 0.0;
        for wi in &w {
            total += wi;
        }
        let target = spec.top_p as f64 * total;
        let mut acc = 0.0;
        for (i, wi) in w.iter().enumerate() {
            acc += wi;
            if acc >= target {
                keep = i + 1;
                break;
            }
        }
    }
    if spec.min_p > 0.0 {
        let floor = spec.min_p.ln();
        keep = (0..keep).take_while(|&i| v(i) - zmax >= floor).count().max(1);
    }
    keep
}

/// Reduces one row of raw logits per `spec` (see the module docs for the exact order), and
/// scores `target` when given.
pub fn reduce_row(raw: &[f32], spec: &SamplingSpec, target: Option<u32>) -> Result<RowReduction, SamplingError> {
    if raw.is_empty() {
        return Err(SamplingError::Empty);
    }
    if let Some(i) = raw.iter().position(|v| v.is_nan()) {
        return Err(SamplingError::NaN(i as u32));
    }
    spec.validate()?;
    let vocab = raw.len();
    let lse = logsumexp(raw);
    let target_logprob = match target {
        Some(t) if (t as usize) < vocab => Some(raw[t as usize] - lse),
        Some(t) => return Err(SamplingError::TokenOutOfRange { token: t, vocab }),
        None => None,
    };
    let (top_ids, top_logprobs) = if spec.top_logprobs > 0 {
        let all: Vec<(u32, f32)> = raw.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
        top_n(all, spec.top_logprobs as usize).into_iter().map(|(i, v)| (i, v - lse)).unzip()
    } else {
        (Vec::new(), Vec::new())
    };

    let z = spec.penalised(raw)?;
    let cands: Vec<(u32, f32)> = if spec.temperature == 0.0 {
        // Greedy: the argmax, lowest id on ties; a single candidate with logit 0.
        let mut best: Option<(u32, f32)> = None;
        for (i, &v) in z.iter().enumerate() {
            if v > f32::NEG_INFINITY && best.is_none_or(|(_, b)| v > b) {
                best = Some((i as u32, v));
            }
        }
        vec![(best.ok_or(SamplingError::NoCandidates)?.0, 0.0)]
    } else {
        let t = spec.temperature;
        let finite: Vec<(u32, f32)> =
            z.iter().enumerate().filter(|(_, v)| **v > f32::NEG_INFINITY).map(|(i, &v)| (i as u32, v / t)).collect();
        if finite.is_empty() {
            return Err(SamplingError::NoCandidates);
        }
        let k = if spec.top_k == 0 { finite.len() } else { (spec.top_k as usize).min(finite.len()) };
        let mut c = top_n(finite, k);
        c.truncate(keep_after_cuts(c.len(), |i| c[i].1, spec));
        c
    };
    let mut out = RowReduction { raw_logsumexp: lse, top_ids, top_logprobs, target_logprob, ..Default::default() };
    for (id, v) in cands {
        out.candidate_ids.push(id);
        out.candidate_logits.push(v);
        out.candidate_raw_logits.push(raw[id as usize]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn softmax(x: &[f32]) -> Vec<f64> {
        let l = logsumexp(x) as f64;
        x.iter().map(|&v| (v as f64 - l).exp()).collect()
    }

    /// The processed distribution computed the slow, obvious way over the full vocabulary.
    fn full_distribution(raw: &[f32], s: &SamplingSpec) -> Vec<f64> {
        let mut z = s.penalised(raw).unwrap();
        if s.temperature == 0.0 {
            let mut best = 0;
            for i in 0..z.len() {
                if z[i] > z[best] {
                    best = i;
                }
            }
            let mut p = vec![0.0; z.len()];
            p[best] = 1.0;
            return p;
        }
        for v in &mut z {
            *v /= s.temperature;
        }
        let mut order: Vec<usize> = (0..z.len()).filter(|&i| z[i] > f32::NEG_INFINITY).collect();
        order.sort_by(|&a, &b| z[b].partial_cmp(&z[a]).unwrap().then(a.cmp(&b)));
        if s.top_k > 0 {
            order.truncate(s.top_k as usize);
        }
        if s.top_p > 0.0 && s.top_p < 1.0 {
            let m = z[order[0]];
            let w: Vec<f64> = order.iter().map(|&i| ((z[i] - m) as f64).exp()).collect();
            let total: f64 = w.iter().sum();
            let mut acc = 0.0;
            let mut n = order.len();
            for (j, wj) in w.iter().enumerate() {
                acc += wj / total;
                if acc >= s.top_p as f64 - 1e-12 {
                    n = j + 1;
                    break;
                }
            }
            order.truncate(n);
        }
        if s.min_p > 0.0 {
            let m = z[order[0]];
            order.retain(|&i| ((z[i] - m) as f64).exp() >= s.min_p as f64 * 0.999_999);
        }
        let kept: Vec<f32> = order.iter().map(|&i| z[i]).collect();
        let p = softmax(&kept);
        let mut full = vec![0.0; z.len()];
        for (j, &i) in order.iter().enumerate() {
            full[i] = p[j];
        }
        full
    }

    fn candidate_distribution(r: &RowReduction, vocab: usize) -> Vec<f64> {
        let p = softmax(&r.candidate_logits);
        let mut full = vec![0.0; vocab];
        for (j, &i) in r.candidate_ids.iter().enumerate() {
            full[i as usize] = p[j];
        }
        full
    }

    /// A deterministic pseudo-random row (xorshift), with some exact ties.
    fn row(seed: u64, n: usize) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x % 4000) as f32 / 400.0 - 5.0).round_ties_even() * if x % 3 == 0 { 1.0 } else { 0.37 }
            })
            .collect()
    }

    #[test]
    fn defaults_keep_the_whole_vocabulary_with_raw_logits() {
        let raw = row(1, 97);
        let r = reduce_row(&raw, &SamplingSpec::default(), Some(5)).unwrap();
        assert_eq!(r.candidate_ids.len(), 97);
        let mut ids = r.candidate_ids.clone();
        ids.sort();
        assert_eq!(ids, (0..97).collect::<Vec<_>>());
        assert_eq!(r.candidate_logits, r.candidate_raw_logits);
        for (&i, &v) in r.candidate_ids.iter().zip(&r.candidate_raw_logits) {
            assert_eq!(v, raw[i as usize]);
        }
        assert!((r.target_logprob.unwrap() - (raw[5] - logsumexp(&raw))).abs() < 1e-6);
    }

    #[test]
    fn candidates_match_the_full_processed_distribution() {
        let specs = [
            SamplingSpec { temperature: 0.7, top_k: 10, ..Default::default() },
            SamplingSpec { temperature: 1.3, top_p: 0.9, ..Default::default() },
            SamplingSpec { temperature: 1.0, top_k: 40, top_p: 0.95, ..Default::default() },
            SamplingSpec { temperature: 0.5, min_p: 0.1, ..Default::default() },
            SamplingSpec { temperature: 1.0, top_k: 20, top_p: 0.8, min_p: 0.05, ..Default::default() },
            SamplingSpec {
                temperature: 0.9,
                top_p: 0.7,
                presence_penalty: 0.5,
                frequency_penalty: 0.3,
                repetition_penalty: 1.3,
                history: vec![(3, 2), (10, 1), (11, 0), (50, 4)],
                logit_bias: vec![(7, 3.0), (8, f32::NEG_INFINITY), (60, -2.0)],
                ..Default::default()
            },
            SamplingSpec { temperature: 0.0, repetition_penalty: 2.0, history: vec![(0, 1), (1, 1)], ..Default::default() },
        ];
        for seed in 0..40 {
            let raw = row(seed, 200);
            for s in &specs {
                let r = reduce_row(&raw, s, None).unwrap();
                let got = candidate_distribution(&r, raw.len());
                let want = full_distribution(&raw, s);
                for i in 0..raw.len() {
                    assert!((got[i] - want[i]).abs() < 1e-9, "seed {seed} spec {s:?} token {i}: {} vs {}", got[i], want[i]);
                }
                // Candidate order: final logit descending, ties by id.
                for w in r.candidate_ids.windows(2).zip(r.candidate_logits.windows(2)) {
                    assert!(w.1[0] > w.1[1] || (w.1[0] == w.1[1] && w.0[0] < w.0[1]));
                }
            }
        }
    }

    #[test]
    fn greedy_ties_go_to_the_lowest_id() {
        let raw = vec![1.0, 3.0, 2.0, 3.0];
        let r = reduce_row(&raw, &SamplingSpec { temperature: 0.0, ..Default::default() }, None).unwrap();
        assert_eq!(r.candidate_ids, vec![1]);
        assert_eq!(r.candidate_logits, vec![0.0]);
        assert_eq!(r.candidate_raw_logits, vec![3.0]);
        // top_k cuts ties deterministically too.
        let r = reduce_row(&raw, &SamplingSpec { top_k: 1, ..Default::default() }, None).unwrap();
        assert_eq!(r.candidate_ids, vec![1]);
    }

    #[test]
    fn penalties_follow_the_documented_order() {
        let raw = vec![2.0, -2.0, 1.0, 0.0];
        let s = SamplingSpec {
            repetition_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            history: vec![(0, 2), (1, 1)],
            logit_bias: vec![(2, 1.5)],
            temperature: 2.0,
            ..Default::default()
        };
        let r = reduce_row(&raw, &s, None).unwrap();
        // token 0: 2/2 - (0.25*2 + 0.5) = 0 ; token 1: -2*2 - 0.75 = -4.75 ; token 2: 2.5 ; 3: 0.
        let got: std::collections::HashMap<u32, f32> = r.candidate_ids.iter().copied().zip(r.candidate_logits.iter().copied()).collect();
        assert_eq!(got[&0], 0.0);
        assert_eq!(got[&1], -4.75 / 2.0);
        assert_eq!(got[&2], 2.5 / 2.0);
        assert_eq!(got[&3], 0.0);
        assert_eq!(r.candidate_ids, vec![2, 0, 3, 1]);
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_p() {
        // Probabilities 0.5, 0.25, 0.125, 0.125 (logits ln of them).
        let raw: Vec<f32> = [0.5f32, 0.25, 0.125, 0.125].iter().map(|p| p.ln()).collect();
        let ids = |p: f32| reduce_row(&raw, &SamplingSpec { top_p: p, ..Default::default() }, None).unwrap().candidate_ids;
        assert_eq!(ids(0.5), vec![0]);
        assert_eq!(ids(0.6), vec![0, 1]);
        assert_eq!(ids(0.75), vec![0, 1]);
        assert_eq!(ids(0.8), vec![0, 1, 2]);
        assert_eq!(ids(0.99), vec![0, 1, 2, 3]);
        // min_p relative to the max: 0.125 / 0.5 = 0.25.
        let r = reduce_row(&raw, &SamplingSpec { min_p: 0.3, ..Default::default() }, None).unwrap();
        assert_eq!(r.candidate_ids, vec![0, 1]);
    }

    #[test]
    fn top_logprobs_are_raw_and_sorted() {
        let raw = row(7, 300);
        let s = SamplingSpec { top_logprobs: 5, temperature: 0.0, repetition_penalty: 3.0, history: vec![(0, 1)], ..Default::default() };
        let r = reduce_row(&raw, &s, Some(299)).unwrap();
        let lse = logsumexp(&raw);
        let mut order: Vec<u32> = (0..300).collect();
        order.sort_by(|&a, &b| raw[b as usize].partial_cmp(&raw[a as usize]).unwrap().then(a.cmp(&b)));
        assert_eq!(r.top_ids, order[..5].to_vec());
        for (&i, &lp) in r.top_ids.iter().zip(&r.top_logprobs) {
            assert_eq!(lp, raw[i as usize] - lse);
        }
        assert_eq!(r.target_logprob, Some(raw[299] - lse));
        assert_eq!(r.raw_logsumexp, lse);
    }

    #[test]
    fn an_allowed_token_mask_is_a_ban_of_every_other_token_before_the_cuts() {
        let raw = row(3, 203);
        let allowed: Vec<u32> = (0..203).filter(|t| t % 7 == 2 || t % 11 == 0).collect();
        let mut mask = vec![0u8; 203usize.div_ceil(8)];
        for &t in &allowed {
            mask[t as usize / 8] |= 1 << (t % 8);
        }
        let bans: Vec<(u32, f32)> = (0..203).filter(|t| !allowed.contains(t)).map(|t| (t, f32::NEG_INFINITY)).collect();
        for base in [
            SamplingSpec { temperature: 0.0, ..Default::default() },
            SamplingSpec { temperature: 0.8, top_k: 5, top_p: 0.9, ..Default::default() },
            SamplingSpec { temperature: 1.0, min_p: 0.2, logit_bias: vec![(2, 1.0)], top_logprobs: 3, ..Default::default() },
        ] {
            let masked = reduce_row(&raw, &SamplingSpec { allowed: Some(mask.clone().into()), ..base.clone() }, Some(4)).unwrap();
            let mut banned = base.clone();
            banned.logit_bias.extend(bans.iter().filter(|b| !base.logit_bias.iter().any(|x| x.0 == b.0)));
            assert_eq!(masked, reduce_row(&raw, &banned, Some(4)).unwrap(), "{base:?}");
            assert!(masked.candidate_ids.iter().all(|t| allowed.contains(t)));
            // Raw logprobs stay the model's own: the target and top_logprobs ignore the mask.
            assert_eq!(masked.target_logprob, Some(raw[4] - logsumexp(&raw)));
        }
        // A short mask bans the tokens past it; a long one's extra bits are ignored.
        let short = SamplingSpec { allowed: Some(vec![0xffu8; 3].into()), temperature: 1.0, ..Default::default() };
        let mut ids = reduce_row(&raw, &short, None).unwrap().candidate_ids;
        ids.sort();
        assert_eq!(ids, (0..24).collect::<Vec<u32>>());
        let long = SamplingSpec { allowed: Some(vec![0xffu8; 40].into()), ..Default::default() };
        assert_eq!(reduce_row(&raw, &long, None).unwrap().candidate_ids.len(), 203);
        let none = SamplingSpec { allowed: Some(vec![0u8; 26].into()), ..Default::default() };
        assert_eq!(reduce_row(&raw, &none, None), Err(SamplingError::NoCandidates));
    }

    #[test]
    fn bad_inputs_are_errors() {
        let raw = vec![0.0, 1.0];
        assert_eq!(reduce_row(&[], &SamplingSpec::default(), None), Err(SamplingError::Empty));
        assert_eq!(reduce_row(&[0.0, f32::NAN], &SamplingSpec::default(), None), Err(SamplingError::NaN(1)));
        assert!(matches!(reduce_row(&raw, &SamplingSpec::default(), Some(2)), Err(SamplingError::TokenOutOfRange { .. })));
        let ban_all = SamplingSpec { logit_bias: vec![(0, f32::NEG_INFINITY), (1, f32::NEG_INFINITY)], ..Default::default() };
        assert_eq!(reduce_row(&raw, &ban_all, None), Err(SamplingError::NoCandidates));
        for s in [
            SamplingSpec { temperature: -1.0, ..Default::default() },
            SamplingSpec { min_p: 1.5, ..Default::default() },
            SamplingSpec { repetition_penalty: 0.0, ..Default::default() },
            SamplingSpec { top_logprobs: 21, ..Default::default() },
            SamplingSpec { history: vec![(9, 1)], ..Default::default() },
        ] {
            assert!(reduce_row(&raw, &s, None).is_err(), "{s:?}");
        }
    }
}
