//! RMSNorm (plain and the cross-rank full-width variant for q/k) and partial NeoX RoPE.

/// Sum of squares, accumulated in f64 so sharded and unsharded sums agree closely.
pub fn sum_sq(x: &[f32]) -> f64 {
    x.iter().map(|&v| (v as f64) * (v as f64)).sum()
}

/// `x * w / sqrt(sum_sq / n + eps)` in place, given the (possibly cross-rank) sum of squares
/// over the full width `n`.
pub fn rms_scale(x: &mut [f32], w: &[f32], sum_sq: f64, n: usize, eps: f32) {
    let inv = 1.0 / ((sum_sq / n as f64) as f32 + eps).sqrt();
    for (v, &wi) in x.iter_mut().zip(w) {
        *v = *v * inv * wi;
    }
}

/// RMSNorm of `x` into `out`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    out.copy_from_slice(x);
    rms_scale(out, w, sum_sq(x), x.len(), eps);
}

/// Rotation table for one position: (cos, sin) for each of the `rotary_dim / 2` frequency pairs.
pub fn rope_table(pos: usize, rotary_dim: usize, theta: f32) -> Vec<(f32, f32)> {
    (0..rotary_dim / 2)
        .map(|i| {
            let inv_freq = 1.0 / (theta as f64).powf(2.0 * i as f64 / rotary_dim as f64);
            let a = pos as f64 * inv_freq;
            (a.cos() as f32, a.sin() as f32)
        })
        .collect()
}

/// NeoX (rotate-half) RoPE on the first `2 * table.len()` dims of each `head_dim`-wide head in
/// `x`; the remaining dims of each head pass through.
pub fn apply_rope(x: &mut [f32], head_dim: usize, table: &[(f32, f32)]) {
    let half = table.len();
    for head in x.chunks_exact_mut(head_dim) {
        for (i, &(c, s)) in table.iter().enumerate() {
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * c - b * s;
            head[i + half] = b * c + a * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_rotates_only_the_leading_dims_and_preserves_norm() {
        let mut x: Vec<f32> = (0..16).map(|i| i as f32 * 0.1 + 0.3).collect();
        let orig = x.clone();
        let t = rope_table(7, 4, 10000.0);
        apply_rope(&mut x, 8, &t);
        for h in 0..2 {
            assert_eq!(&x[h * 8 + 4..h * 8 + 8], &orig[h * 8 + 4..h * 8 + 8], "pass-through dims");
            let n0: f32 = orig[h * 8..h * 8 + 4].iter().map(|v| v * v).sum();
            let n1: f32 = x[h * 8..h * 8 + 4].iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-5);
            assert_ne!(&x[h * 8..h * 8 + 4], &orig[h * 8..h * 8 + 4]);
        }
        // Position 0 is the identity.
        let mut y = orig.clone();
        apply_rope(&mut y, 8, &rope_table(0, 4, 10000.0));
        assert_eq!(y, orig);
    }

    #[test]
    fn rms_norm_matches_definition() {
        let x = [1.0f32, -2.0, 3.0, 0.5];
        let w = [1.0f32, 0.5, 2.0, 1.0];
        let mut out = [0.0; 4];
        rms_norm(&x, &w, 1e-6, &mut out);
        let rms = ((1.0 + 4.0 + 9.0 + 0.25) / 4.0f32 + 1e-6).sqrt();
        for i in 0..4 {
            assert!((out[i] - x[i] / rms * w[i]).abs() < 1e-6);
        }
    }
}
