//! Finishing a row reduction from a *partial* one, so a device can reduce a logits row to a few
//! KB and the host still returns exactly what [`reduce_row`](super::reduce_row) would.
//!
//! A partial reducer (the CUDA kernels in `kernels/sampling.cu`) computes, per [`plan`]: the raw
//! log-sum-exp, the raw top `top_logprobs`, the target's raw logit, the number of tokens whose
//! penalised logit is `> -inf`, the first `candidates` tokens in candidate order (final logit
//! descending, ties by id) with their final and raw logits, and, when top_p must be decided
//! beyond those, `Σ exp((v - v_max) as f64)` over every finite final logit `v` (any summation
//! order). [`finish`] rebuilds the [`RowReduction`] from that, or returns `None` when the data
//! cannot decide it (then the caller reduces the full row with `reduce_row`).
//!
//! Exactness: candidates, their order and their logits are the same values `reduce_row` gets
//! (the same f32 operations), and every top_k / min_p cut and every top_p cut inside the held
//! candidates is recomputed here with `reduce_row`'s own arithmetic. Only a top_p cut against a
//! total summed elsewhere in another order differs: that total is within `(2n + 8)·2⁻⁵²`
//! relative of `reduce_row`'s, and a cut that lands within that margin is `None`, never a guess.
//! The log-sum-exp (hence `top_logprobs` and `target_logprob`) is the partial reducer's own.

use super::exp::det_exp;
use super::{RowReduction, SamplingError, SamplingSpec};

/// What a partial reducer must compute for one row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowPlan {
    /// Leading candidates (in candidate order) to return; 1 for greedy.
    pub candidates: usize,
    /// Whether the top_p total over every finite candidate logit is needed.
    pub need_total: bool,
    /// The row cannot be reduced partially (invalid spec or token, duplicate history or bias
    /// entries, or a candidate set certainly larger than the cap): reduce the full row.
    pub full_row: bool,
    /// The candidates are the whole set top_k leaves (greedy: the argmax), so every cut and the
    /// draw are decided from them alone: a device can draw the row's token itself
    /// ([`draw_leading`](super::draw::draw_leading), with `candidates` as the bound).
    pub whole_set: bool,
}

impl RowPlan {
    const FULL: RowPlan = RowPlan { candidates: 0, need_total: false, full_row: true, whole_set: false };
}

/// One row as a partial reducer computed it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowPartial {
    /// `ln Σ exp(raw)` over the whole row.
    pub raw_logsumexp: f32,
    /// The `top_logprobs` highest raw logits (descending, ties by id) and their values.
    pub top_ids: Vec<u32>,
    pub top_raw: Vec<f32>,
    /// The target token's raw logit, when a target was given.
    pub target_raw: Option<f32>,
    /// Tokens whose penalised logit is `> -inf`.
    pub n_finite: usize,
    /// The first candidates in candidate order: ids, final logits (`z / t`, or `z` for
    /// greedy), raw logits.
    pub cand_ids: Vec<u32>,
    pub cand_logits: Vec<f32>,
    pub cand_raw: Vec<f32>,
    /// `Σ exp((v - v_max) as f64)` over every finite final logit, when planned.
    pub total: Option<f64>,
}

fn has_duplicates<T: Copy>(entries: &[(u32, T)]) -> bool {
    let mut ids: Vec<u32> = entries.iter().map(|e| e.0).collect();
    ids.sort_unstable();
    ids.windows(2).any(|w| w[0] == w[1])
}

fn top_p_active(spec: &SamplingSpec) -> bool {
    spec.top_p > 0.0 && spec.top_p < 1.0
}

/// What to compute for a row of `vocab` logits, holding at most `cap` candidates.
pub fn plan(spec: &SamplingSpec, target: Option<u32>, vocab: usize, cap: usize) -> RowPlan {
    let in_range = |t: u32| (t as usize) < vocab;
    if vocab == 0
        || cap == 0
        || spec.validate().is_err()
        || !target.is_none_or(in_range)
        || !spec.history.iter().all(|h| in_range(h.0))
        || !spec.logit_bias.iter().all(|b| in_range(b.0))
        || has_duplicates(&spec.history)
        || has_duplicates(&spec.logit_bias)
    {
        return RowPlan::FULL;
    }
    if spec.temperature == 0.0 {
        return RowPlan { candidates: 1, need_total: false, full_row: false, whole_set: true };
    }
    let mut k = if spec.top_k == 0 { vocab } else { (spec.top_k as usize).min(vocab) };
    if let Some(m) = &spec.allowed {
        // A mask (structured outputs) bounds the set: often a few tokens, held whole.
        k = k.min(allowed_count(m, vocab).max(1));
    }
    let top_p = top_p_active(spec);
    if k > cap && !top_p && spec.min_p <= 0.0 {
        return RowPlan::FULL;
    }
    RowPlan { candidates: k.min(cap), need_total: top_p && k > cap, full_row: false, whole_set: k <= cap }
}

/// Tokens below `vocab` an allowed-token mask lets through (bit `t % 8` of byte `t / 8`).
fn allowed_count(mask: &[u8], vocab: usize) -> usize {
    let full = (vocab / 8).min(mask.len());
    let mut n: usize = mask[..full].iter().map(|b| b.count_ones() as usize).sum();
    if full < mask.len() && vocab % 8 != 0 {
        n += (mask[full] & ((1u8 << (vocab % 8)) - 1)).count_ones() as usize;
    }
    n
}

/// Relative bound on the difference between two f64 sums of the same `n` positive terms in
/// different orders (each term's `exp` within 2 ulp), with slack.
fn total_margin(n: usize) -> f64 {
    (2 * n + 8) as f64 * f64::EPSILON
}

/// The number of candidates `reduce_row` keeps, decided from the partial data, or `None`.
fn kept(p: &RowPartial, spec: &SamplingSpec) -> Option<usize> {
    let have = p.cand_ids.len();
    let k = if spec.top_k == 0 { p.n_finite } else { (spec.top_k as usize).min(p.n_finite) };
    let c = &p.cand_logits;
    let zmax = c[0];
    if k <= have {
        // reduce_row's own cuts on the whole kept set.
        return Some(super::keep_after_cuts(k, |i| c[i], spec));
    }
    if !zmax.is_finite() {
        return None;
    }
    // Only a prefix of the kept set is held: bound each cut by [lo, hi], usize::MAX = unbounded
    // (an inactive min_p is exactly "no cut", also usize::MAX).
    const INF: usize = usize::MAX;
    let (p_lo, p_hi) = if top_p_active(spec) {
        if k < p.n_finite {
            return None; // the top_p total is over a top_k set larger than what is held
        }
        let total = p.total?;
        let target = spec.top_p as f64 * total;
        let margin = target * total_margin(p.n_finite);
        let mut acc = 0.0;
        let mut bounds = (have + 1, INF);
        for (i, &v) in c.iter().enumerate() {
            acc += det_exp((v - zmax) as f64);
            if acc >= target - margin {
                bounds = (i + 1, if acc >= target + margin { i + 1 } else { INF });
                break;
            }
        }
        bounds
    } else {
        (k, k)
    };
    let (m_lo, m_hi) = if spec.min_p > 0.0 {
        let floor = spec.min_p.ln();
        let n = c.iter().take_while(|&&v| v - zmax >= floor).count();
        if n < have { (n, n) } else { (have, INF) }
    } else {
        (INF, INF)
    };
    // min(keep_p, keep_m) lies in [min(p_lo, m_lo), min(p_hi, m_hi)]: decided when they meet.
    let (lo, hi) = (p_lo.min(m_lo), p_hi.min(m_hi));
    if lo != hi {
        return None;
    }
    let keep = if spec.min_p > 0.0 { lo.max(1) } else { lo };
    (keep <= have).then_some(keep)
}

/// The exact [`RowReduction`] from a partial one computed per [`plan`], or `None` when the
/// partial data cannot decide it (reduce the full row instead).
pub fn finish(p: &RowPartial, spec: &SamplingSpec, target: Option<u32>) -> Option<Result<RowReduction, SamplingError>> {
    let lse = p.raw_logsumexp;
    let target_logprob = match target {
        Some(_) => Some(p.target_raw? - lse),
        None => None,
    };
    if p.top_ids.len() != p.top_raw.len() {
        return None;
    }
    let mut out = RowReduction {
        raw_logsumexp: lse,
        top_ids: p.top_ids.clone(),
        top_logprobs: p.top_raw.iter().map(|&v| v - lse).collect(),
        target_logprob,
        ..Default::default()
    };
    if p.n_finite == 0 {
        return Some(Err(SamplingError::NoCandidates));
    }
    let have = p.cand_ids.len();
    if have == 0 || p.cand_logits.len() != have || p.cand_raw.len() != have {
        return None;
    }
    if spec.temperature == 0.0 {
        out.candidate_ids.push(p.cand_ids[0]);
        out.candidate_logits.push(0.0);
        out.candidate_raw_logits.push(p.cand_raw[0]);
        return Some(Ok(out));
    }
    let keep = kept(p, spec)?;
    out.candidate_ids = p.cand_ids[..keep].to_vec();
    out.candidate_logits = p.cand_logits[..keep].to_vec();
    out.candidate_raw_logits = p.cand_raw[..keep].to_vec();
    Some(Ok(out))
}

/// The partial reduction of a host row per `plan`, computed the obvious way: the CPU twin of
/// the device kernels (tests; `total` is summed in reverse order, as another reducer may).
pub fn partial_from_row(raw: &[f32], spec: &SamplingSpec, target: Option<u32>, plan: &RowPlan) -> RowPartial {
    let order = |v: &mut Vec<(u32, f32)>| v.sort_by(super::by_logit_desc);
    let mut all: Vec<(u32, f32)> = raw.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
    order(&mut all);
    all.truncate(spec.top_logprobs as usize);
    let z = spec.penalised(raw).unwrap_or_else(|_| raw.to_vec());
    let t = spec.temperature;
    let mut fin: Vec<(u32, f32)> =
        z.iter().enumerate().filter(|(_, v)| **v > f32::NEG_INFINITY).map(|(i, &v)| (i as u32, if t > 0.0 { v / t } else { v })).collect();
    let n_finite = fin.len();
    order(&mut fin);
    let total = (plan.need_total && n_finite > 0).then(|| {
        let m = fin[0].1;
        fin.iter().rev().map(|&(_, v)| det_exp((v - m) as f64)).sum()
    });
    fin.truncate(plan.candidates);
    RowPartial {
        raw_logsumexp: super::logsumexp(raw),
        top_ids: all.iter().map(|e| e.0).collect(),
        top_raw: all.iter().map(|e| e.1).collect(),
        target_raw: target.map(|t| raw[t as usize]),
        n_finite,
        cand_ids: fin.iter().map(|e| e.0).collect(),
        cand_logits: fin.iter().map(|e| e.1).collect(),
        cand_raw: fin.iter().map(|e| raw[e.0 as usize]).collect(),
        total,
    }
}

#[cfg(test)]
mod tests {
    use super::super::reduce_row;
    use super::*;

    fn row(seed: u64, n: usize, ties: bool) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let u = (x >> 11) as f64 / (1u64 << 53) as f64;
                if ties { ((u * 40.0).floor() / 4.0 - 5.0) as f32 } else { (u * 12.0 - 6.0) as f32 }
            })
            .collect()
    }

    /// A mask of `n` tokens' bits letting through those `keep` says.
    fn mask(n: u32, keep: impl Fn(u32) -> bool) -> std::sync::Arc<[u8]> {
        let mut m = vec![0u8; (n as usize).div_ceil(8)];
        for t in (0..n).filter(|&t| keep(t)) {
            m[t as usize / 8] |= 1 << (t % 8);
        }
        m.into()
    }

    fn specs(vocab: u32) -> Vec<SamplingSpec> {
        let d = SamplingSpec::default;
        vec![
            SamplingSpec { temperature: 0.0, ..d() },
            SamplingSpec { temperature: 0.0, repetition_penalty: 2.0, history: vec![(0, 1), (vocab - 1, 3)], ..d() },
            SamplingSpec { temperature: 0.7, top_k: 10, ..d() },
            SamplingSpec { temperature: 1.0, top_k: 40, top_p: 0.95, ..d() },
            SamplingSpec { temperature: 1.3, top_p: 0.9, ..d() },
            SamplingSpec { temperature: 0.25, top_p: 0.5, ..d() },
            SamplingSpec { temperature: 0.5, min_p: 0.1, ..d() },
            SamplingSpec { temperature: 1.0, min_p: 0.9, top_p: 0.99, ..d() },
            SamplingSpec { temperature: 1.0, top_k: 500, min_p: 0.5, ..d() },
            SamplingSpec { temperature: 1.0, ..d() },
            SamplingSpec {
                temperature: 0.9,
                top_p: 0.7,
                presence_penalty: 0.5,
                frequency_penalty: 0.3,
                repetition_penalty: 1.3,
                history: vec![(3, 2), (10, 1), (11, 0), (50, 4)],
                logit_bias: vec![(7, 3.0), (8, f32::NEG_INFINITY), (60, -2.0), (3, 1.0)],
                top_logprobs: 5,
                ..d()
            },
            SamplingSpec { temperature: 0.8, top_k: 3, top_logprobs: 20, ..d() },
            // Allowed-token masks (structured outputs): greedy, sampled with cuts, one shorter
            // than the row (the tokens past it banned) beside a bias, one that bans every token.
            SamplingSpec { temperature: 0.0, allowed: Some(mask(vocab, |t| t % 5 == 3)), ..d() },
            SamplingSpec { temperature: 1.0, top_p: 0.9, top_logprobs: 3, allowed: Some(mask(vocab, |t| t % 3 != 0)), ..d() },
            SamplingSpec { temperature: 0.7, logit_bias: vec![(1, 4.0), (8, f32::NEG_INFINITY)], allowed: Some(mask(vocab / 2, |t| t % 7 == 1)), ..d() },
            SamplingSpec { temperature: 1.0, top_k: 40, allowed: Some(mask(vocab, |t| t < 3 || t == vocab - 1)), ..d() },
            SamplingSpec { temperature: 1.0, allowed: Some(mask(vocab, |_| false)), ..d() },
        ]
    }

    /// Whenever `finish` decides, it equals `reduce_row`; holding the whole row it always decides.
    #[test]
    fn finish_equals_reduce_row_or_declines() {
        let (mut decided, mut decided_partial, mut declined) = (0, 0, 0);
        for (n, ties) in [(97usize, false), (300, true), (1000, false), (2048, true)] {
            for seed in 0..12 {
                let raw = row(seed * 7 + n as u64, n, ties);
                for s in specs(n as u32) {
                    let target = Some((seed as u32 * 13) % n as u32);
                    let want = reduce_row(&raw, &s, target);
                    for cap in [1usize, 8, 64, 4096] {
                        let pl = plan(&s, target, n, cap);
                        if pl.full_row {
                            assert!(cap < n, "only a small cap may need the full row: {s:?}");
                            continue;
                        }
                        let p = partial_from_row(&raw, &s, target, &pl);
                        match finish(&p, &s, target) {
                            Some(got) => {
                                assert_eq!(got, want, "n {n} seed {seed} cap {cap} {s:?}");
                                decided += 1;
                                if cap < n && pl.candidates < n {
                                    decided_partial += 1;
                                }
                            }
                            None => {
                                assert!(cap < n, "cap {cap} holds the whole row, must decide: {s:?}");
                                declined += 1;
                            }
                        }
                    }
                }
            }
        }
        // Both branches ran: cuts decided from a prefix of the candidates, and declines.
        assert!(decided_partial > 100 && declined > 0 && decided > declined, "decided {decided} ({decided_partial} from a prefix), declined {declined}");
    }

    #[test]
    fn plan_sends_unbounded_sets_and_bad_specs_to_the_full_row() {
        let s = SamplingSpec::default();
        assert!(plan(&s, None, 200_064, 1024).full_row);
        assert!(!plan(&s, None, 1000, 1024).full_row);
        assert_eq!(plan(&SamplingSpec { top_k: 40, ..s.clone() }, None, 200_064, 1024).candidates, 40);
        let p = plan(&SamplingSpec { top_p: 0.9, ..s.clone() }, None, 200_064, 1024);
        assert_eq!((p.candidates, p.need_total, p.full_row, p.whole_set), (1024, true, false, false));
        // Whole sets: top_k within the cap (or a vocabulary within it), and greedy rows.
        let p = plan(&SamplingSpec { top_k: 40, top_p: 0.95, ..s.clone() }, None, 200_064, 1024);
        assert_eq!((p.candidates, p.need_total, p.whole_set), (40, false, true));
        assert!(plan(&SamplingSpec { top_k: 1024, ..s.clone() }, None, 200_064, 1024).whole_set);
        assert!(!plan(&SamplingSpec { top_k: 1025, min_p: 0.1, ..s.clone() }, None, 200_064, 1024).whole_set);
        assert!(plan(&SamplingSpec { top_p: 0.5, ..s.clone() }, None, 1000, 1024).whole_set);
        // An allowed-token mask (structured outputs) is reduced partially too, and bounds the
        // set by the tokens it lets through (bits past the vocabulary not counted).
        let masked = SamplingSpec { temperature: 0.0, allowed: Some(vec![0xffu8; 125].into()), ..s.clone() };
        assert!(!plan(&masked, None, 1000, 1024).full_row);
        let few = SamplingSpec { allowed: Some(vec![0b1000_0101u8; 25_008].into()), ..s.clone() };
        let p = plan(&few, None, 200_064, 1024);
        assert_eq!((p.candidates, p.full_row, p.whole_set), (0, true, false), "75,024 tokens allowed");
        let mut sparse = vec![0u8; 25_008];
        sparse[7] = 0b11;
        sparse[25_007] = 0xff;
        let p = plan(&SamplingSpec { allowed: Some(sparse.clone().into()), ..s.clone() }, None, 200_062, 1024);
        assert_eq!((p.candidates, p.full_row, p.whole_set), (8, false, true), "2 + 6 of the last byte's bits below the vocabulary");
        assert_eq!(plan(&SamplingSpec { allowed: Some(vec![0u8; 3].into()), ..s.clone() }, None, 20, 1024).candidates, 1);
        assert!(plan(&SamplingSpec { temperature: 0.0, ..s.clone() }, None, 200_064, 1024).whole_set);
        assert!(plan(&SamplingSpec { history: vec![(1, 1), (1, 2)], ..s.clone() }, None, 10, 4).full_row);
        assert!(plan(&SamplingSpec { logit_bias: vec![(10, 1.0)], ..s.clone() }, None, 10, 4).full_row);
        assert!(plan(&s, Some(10), 10, 64).full_row);
        assert!(plan(&SamplingSpec { temperature: -1.0, ..s.clone() }, None, 10, 64).full_row);
    }

    /// A top_p cut whose cumulative sum lands within the total's margin is declined.
    #[test]
    fn top_p_near_the_margin_is_declined() {
        // Four equal probabilities; top_p 0.5 lands exactly on the second (acc == target).
        let raw = vec![0.0f32; 4];
        let s = SamplingSpec { top_p: 0.5, ..Default::default() };
        let pl = plan(&s, None, 4, 2);
        assert!(pl.need_total && !pl.full_row);
        let p = partial_from_row(&raw, &s, None, &pl);
        assert_eq!(finish(&p, &s, None), None);
        // With the whole row held it is reduce_row's own arithmetic again.
        let pl = plan(&s, None, 4, 4);
        let p = partial_from_row(&raw, &s, None, &pl);
        assert_eq!(finish(&p, &s, None), Some(reduce_row(&raw, &s, None)));
    }

    #[test]
    fn no_candidates_is_the_same_error() {
        let raw = vec![1.0f32, 2.0];
        let s = SamplingSpec { logit_bias: vec![(0, f32::NEG_INFINITY), (1, f32::NEG_INFINITY)], ..Default::default() };
        let pl = plan(&s, None, 2, 1);
        let p = partial_from_row(&raw, &s, None, &pl);
        assert_eq!(finish(&p, &s, None), Some(Err(SamplingError::NoCandidates)));
    }
}
