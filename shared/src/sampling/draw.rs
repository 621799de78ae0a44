//! The final draw among a row's candidates, given one uniform number.
//!
//! The gateway owns the random stream (one ChaCha20 stream per request, seeded from `seed`);
//! it sends each step's uniform with the step, so the head rank draws the same token the
//! gateway would. The rank needs the token at once to feed it to the next step while the
//! gateway is still reading the answer (overlapped decode, docs/SCHEDULER.md); the gateway
//! draws again with the same function and the same number to check the rank's token.
//!
//! - temperature `<= 0` (greedy) or a single candidate: the first in canonical order;
//! - otherwise: softmax over the candidates' final logits in f64 (weights
//!   [`det_exp`]`(logit - max)`, summed one after another), in canonical order (final logit
//!   descending, id ascending; `-0.0` and `+0.0` are equal, as in the candidate order), and the
//!   first candidate whose cumulative weight exceeds `u * total`. The order makes the result
//!   independent of how a rank lists them.
//!
//! The head's GPU draws the same way (`samp_merge`, kernels/sampling.cu) to feed sampled
//! tokens to the next step on the device: every step here is one IEEE operation it repeats.

use super::exp::det_exp;

/// Why no candidate can be drawn (the head rank broke the contract).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum DrawError {
    #[error("the head rank returned no candidates")]
    NoCandidates,
    #[error("the head rank returned {ids} candidate ids but {logits} logits")]
    Ragged { ids: usize, logits: usize },
    #[error("the candidates' logits are not finite")]
    NotFinite,
    #[error("the uniform number {0} is outside [0, 1)")]
    BadUniform(f64),
}

/// Index (into `ids`) of the candidate drawn with the uniform number `u` in `[0, 1)`.
pub fn draw(ids: &[u32], logits: &[f32], temperature: f32, u: f64) -> Result<usize, DrawError> {
    if ids.is_empty() {
        return Err(DrawError::NoCandidates);
    }
    if logits.len() != ids.len() {
        return Err(DrawError::Ragged { ids: ids.len(), logits: logits.len() });
    }
    if logits.iter().any(|l| l.is_nan()) {
        return Err(DrawError::NotFinite);
    }
    if !(0.0..1.0).contains(&u) {
        return Err(DrawError::BadUniform(u));
    }
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap_or(std::cmp::Ordering::Equal).then(ids[a].cmp(&ids[b])));
    if temperature <= 0.0 || order.len() == 1 {
        return Ok(order[0]);
    }
    if !(logits[order[0]] as f64).is_finite() {
        return Err(DrawError::NotFinite);
    }
    Ok(order[walk(order.len(), |j| logits[order[j]], u)])
}

/// The position the uniform `u` picks among `n >= 1` final logits in canonical order (`v(0)`
/// the largest, finite): weights `det_exp(v as f64 - v(0) as f64)` (an f64 difference),
/// summed in order; the first whose cumulative weight exceeds `u * total` (the last, should
/// rounding leave none).
fn walk(n: usize, v: impl Fn(usize) -> f32, u: f64) -> usize {
    let max = v(0) as f64;
    let w: Vec<f64> = (0..n).map(|i| det_exp(v(i) as f64 - max)).collect();
    let mut total = 0.0;
    for wi in &w {
        total += wi;
    }
    let target = u * total;
    let mut acc = 0.0;
    for (i, wi) in w.iter().enumerate() {
        acc += wi;
        if target < acc {
            return i;
        }
    }
    n - 1
}

/// The draw as the head's GPU makes it (`samp_merge`'s pick, kernels/sampling.cu: this is
/// its CPU twin, step for step), [`partial::finish`](super::partial::finish)'s cuts and
/// [`draw`]'s walk over the held candidates:
/// `cand` are a row's leading final logits in candidate order as the device holds them,
/// `n_finite` its count of finite logits, `bound` the size of its candidate set before the
/// top_p / min_p cuts (the plan's `candidates` of a [`whole_set`](super::partial::RowPlan)
/// row: top_k, or the vocabulary). A set larger than what is held, and rows `draw` refuses,
/// give None (no pick). Greedy rows take the first.
pub fn draw_leading(cand: &[f32], n_finite: usize, bound: usize, spec: &super::SamplingSpec, u: f64) -> Option<usize> {
    if cand.is_empty() || !(0.0..1.0).contains(&u) || spec.temperature.is_nan() {
        return None;
    }
    if spec.temperature <= 0.0 {
        return Some(0);
    }
    let k = bound.min(n_finite);
    if k == 0 || k > cand.len() {
        return None;
    }
    // finish's cuts over the first k, then draw's walk over what they keep (candidates
    // already in canonical order).
    let keep = super::keep_after_cuts(k, |i| cand[i], spec);
    if keep == 1 {
        return Some(0);
    }
    if !(cand[0] as f64).is_finite() {
        return None;
    }
    Some(walk(keep, |i| cand[i], u))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_single_candidates_take_the_first_in_canonical_order() {
        assert_eq!(draw(&[5, 9, 2], &[1.0, 3.0, 2.0], 0.0, 0.99).unwrap(), 1);
        // Ties: lowest id.
        assert_eq!(draw(&[7, 3], &[1.0, 1.0], 0.0, 0.5).unwrap(), 1);
        assert_eq!(draw(&[4], &[-2.0], 1.0, 0.7).unwrap(), 0);
    }

    #[test]
    fn the_uniform_walks_the_cumulative_weights_in_canonical_order() {
        // Weights e^0 = 1 (id 8) and e^(-ln 3) = 1/3 (id 2): id 8 holds [0, 0.75).
        let l = [-(3f32.ln()), 0.0];
        let ids = [2u32, 8];
        assert_eq!(draw(&ids, &l, 1.0, 0.0).unwrap(), 1);
        assert_eq!(draw(&ids, &l, 1.0, 0.74).unwrap(), 1);
        assert_eq!(draw(&ids, &l, 1.0, 0.76).unwrap(), 0);
        // The same whatever order the candidates come in.
        assert_eq!(draw(&[8, 2], &[0.0, -(3f32.ln())], 1.0, 0.76).unwrap(), 1);
    }

    #[test]
    fn signed_zeros_tie_and_the_lower_id_comes_first() {
        // Candidate order keys -0.0 as +0.0: the id decides, whichever sign each has.
        assert_eq!(draw(&[9, 4], &[0.0, -0.0], 0.0, 0.5).unwrap(), 1);
        assert_eq!(draw(&[4, 9], &[-0.0, 0.0], 0.0, 0.5).unwrap(), 0);
        // Equal weights: the lower half of [0, 1) is id 4's.
        assert_eq!(draw(&[9, 4], &[0.0, -0.0], 1.0, 0.49).unwrap(), 1);
        assert_eq!(draw(&[9, 4], &[0.0, -0.0], 1.0, 0.51).unwrap(), 0);
    }

    /// The device's fused draw picks what the host's `finish` + `draw` pick, on rows with ties,
    /// signed zeros, -inf bans and every cut.
    #[test]
    fn draw_leading_is_finish_then_draw() {
        use crate::sampling::partial::{finish, partial_from_row, plan};
        use crate::sampling::{SamplingSpec, reduce_row};
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 53) as f64
        };
        let pick = |u: f64, k: usize| ((u * k as f64) as usize).min(k - 1);
        // A min_p whose ln is exactly -0.5: on the quarter grid below, some candidates then sit
        // exactly on the min_p floor (temperature 1).
        let e = (-0.5f32).exp().to_bits();
        let min_p_edge = (e - 8..e + 8).map(f32::from_bits).find(|m| m.ln() == -0.5).expect("an f32 with ln = -0.5");
        let (mut drawn, mut several) = (0, 0);
        for case in 0..3000 {
            let n = [5usize, 64, 300, 2000][pick(next(), 4)];
            let ties = pick(next(), 3) == 0;
            let mut raw: Vec<f32> = (0..n).map(|_| if ties { ((next() * 12.0).floor() / 4.0 - 1.5) as f32 } else { (next() * 14.0 - 7.0) as f32 }).collect();
            if pick(next(), 5) == 0 {
                raw[case % n] = -0.0;
                raw[(case * 7 + 1) % n] = 0.0;
            }
            let spec = SamplingSpec {
                temperature: [1.0, 1.0, 0.7, 1.3, 0.2][pick(next(), 5)],
                // 0: no top_k, the whole (small) vocabulary is the set.
                top_k: [0u32, 1, 2, 20, 40, 64, 1024][pick(next(), 7)],
                top_p: [1.0, 0.95, 0.5, 0.999][pick(next(), 4)],
                min_p: [0.0, 0.0, 0.05, 0.5, min_p_edge, min_p_edge][pick(next(), 6)],
                logit_bias: if pick(next(), 7) == 0 { vec![(0, f32::NEG_INFINITY), (1, 2.5)] } else { Vec::new() },
                ..Default::default()
            };
            // Exact boundaries too: 0, and halves / quarters of totals of equal weights (ties).
            let u = match pick(next(), 8) {
                0 => 0.0,
                1 => 0.5,
                2 => 0.25,
                _ => next(),
            };
            let want = reduce_row(&raw, &spec, None).unwrap();
            let host = draw(&want.candidate_ids, &want.candidate_logits, spec.temperature, u).unwrap();
            let pl = plan(&spec, None, n, 1024);
            if spec.top_k == 0 && n > 1024 {
                assert!(!pl.whole_set, "a set larger than the cap is not whole");
                continue;
            }
            assert!(!pl.full_row && !pl.need_total && pl.whole_set, "{spec:?}");
            let p = partial_from_row(&raw, &spec, None, &pl);
            assert_eq!(finish(&p, &spec, None), Some(Ok(want.clone())));
            let got = draw_leading(&p.cand_logits, p.n_finite, pl.candidates, &spec, u).expect("a pick");
            assert_eq!(p.cand_ids[got], want.candidate_ids[host], "case {case} {spec:?} u {u}");
            drawn += 1;
            several += (want.candidate_ids.len() > 1) as usize;
        }
        assert!(drawn > 2500 && several > 1500, "{several} draws among several candidates");
        // No pick where the device does not hold the set or the uniform is out of range;
        // greedy takes the first.
        let s = SamplingSpec::default();
        assert_eq!(draw_leading(&[1.0, 0.5], 5, 3, &s, 0.3), None);
        assert_eq!(draw_leading(&[1.0, 0.5], 2, 3, &s, 1.0), None);
        assert_eq!(draw_leading(&[1.0, 0.5], 2, 3, &SamplingSpec { temperature: 0.0, ..s.clone() }, 0.99), Some(0));
        assert_eq!(draw_leading(&[1.0, 0.5], 2, 3, &s, 0.99), Some(1));
    }

    #[test]
    fn contract_breaches_are_errors() {
        assert_eq!(draw(&[], &[], 1.0, 0.1), Err(DrawError::NoCandidates));
        assert_eq!(draw(&[1, 2], &[0.0], 1.0, 0.1), Err(DrawError::Ragged { ids: 2, logits: 1 }));
        assert_eq!(draw(&[1], &[f32::NAN], 1.0, 0.1), Err(DrawError::NotFinite));
        assert_eq!(draw(&[1, 2], &[f32::INFINITY, 0.0], 1.0, 0.1), Err(DrawError::NotFinite));
        assert_eq!(draw(&[1], &[0.0], 1.0, 1.0), Err(DrawError::BadUniform(1.0)));
    }
}
