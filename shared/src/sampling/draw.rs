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
    let max = logits[order[0]] as f64;
    if !max.is_finite() {
        return Err(DrawError::NotFinite);
    }
    let weights: Vec<f64> = order.iter().map(|&i| det_exp(logits[i] as f64 - max)).collect();
    let mut total = 0.0;
    for w in &weights {
        total += w;
    }
    let target = u * total;
    let mut acc = 0.0;
    for (k, &i) in order.iter().enumerate() {
        acc += weights[k];
        if target < acc {
            return Ok(i);
        }
    }
    Ok(order[order.len() - 1])
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

    #[test]
    fn contract_breaches_are_errors() {
        assert_eq!(draw(&[], &[], 1.0, 0.1), Err(DrawError::NoCandidates));
        assert_eq!(draw(&[1, 2], &[0.0], 1.0, 0.1), Err(DrawError::Ragged { ids: 2, logits: 1 }));
        assert_eq!(draw(&[1], &[f32::NAN], 1.0, 0.1), Err(DrawError::NotFinite));
        assert_eq!(draw(&[1, 2], &[f32::INFINITY, 0.0], 1.0, 0.1), Err(DrawError::NotFinite));
        assert_eq!(draw(&[1], &[0.0], 1.0, 1.0), Err(DrawError::BadUniform(1.0)));
    }
}
