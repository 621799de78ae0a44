//! The exponential every sampling decision uses (top_p cuts, the draw's softmax walk), built
//! from IEEE additions, subtractions and multiplications only, in one fixed order, so the host
//! and the GPU (`sp_det_exp` in `kernels/sampling.cu`, the same steps with `__dmul_rn` /
//! `__dadd_rn`) get the same bits. A library `exp` differs between them in the last bit, and
//! a draw or cut that lands on that bit would then differ: with the token drawn on the device
//! (overlapped decode feeds it to the next step before the host has drawn), host and device
//! must agree in every case, not almost every case.
//!
//! Method: `x = k ln2 + r` with `k = round(x / ln2)` (Cody-Waite: `ln2` split in a high part
//! whose products with `k` are exact and a low part), `e^r` by its Taylor series to `r^13/13!`
//! in Horner form (`|r| <= ln2 / 2`: the truncation is below 2^-56 relative), times `2^k`
//! (exact). Within 1 ulp of the true value (the tests compare against `f64::exp`).
//!
//! Rust never contracts `a * b + c` into a fused multiply-add, so the plain operators below are
//! the rounding steps the device repeats.

/// `1 / ln 2` rounded to f64.
const LOG2E: f64 = f64::from_bits(0x3ff7_1547_652b_82fe);
/// `ln 2` split: the high part has 21 trailing zero bits, so `k * LN2_HI` is exact for the
/// `|k| <= 1024` used here.
const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
/// `1 / n!` for n = 0..=13, each rounded to f64 (the test recomputes them).
const INV_FACT: [f64; 14] = [
    f64::from_bits(0x3ff0_0000_0000_0000),
    f64::from_bits(0x3ff0_0000_0000_0000),
    f64::from_bits(0x3fe0_0000_0000_0000),
    f64::from_bits(0x3fc5_5555_5555_5555),
    f64::from_bits(0x3fa5_5555_5555_5555),
    f64::from_bits(0x3f81_1111_1111_1111),
    f64::from_bits(0x3f56_c16c_16c1_6c17),
    f64::from_bits(0x3f2a_01a0_1a01_a01a),
    f64::from_bits(0x3efa_01a0_1a01_a01a),
    f64::from_bits(0x3ec7_1de3_a556_c734),
    f64::from_bits(0x3e92_7e4f_b778_9f5c),
    f64::from_bits(0x3e5a_e645_67f5_44e4),
    f64::from_bits(0x3e21_eed8_eff8_d898),
    f64::from_bits(0x3de6_1246_13a8_6d09),
];

/// `e^x`, bit-identical to the device's `sp_det_exp`: 0 below -708 (the results there are
/// below 2^-1021 and every sum it enters holds a 1), +inf from 709, NaN for NaN.
pub fn det_exp(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    if x <= -708.0 {
        return 0.0;
    }
    if x >= 709.0 {
        return f64::INFINITY;
    }
    // `round` is exact and rounds halves away from zero, like CUDA's `round`.
    let k = (x * LOG2E).round();
    let hi = x - k * LN2_HI;
    let r = hi - k * LN2_LO;
    let mut p = INV_FACT[13];
    for &c in INV_FACT[..13].iter().rev() {
        p = p * r + c;
    }
    // -1021 <= k <= 1023: 2^k is a normal number and the product is exact.
    p * f64::from_bits(((k as i64 + 1023) as u64) << 52)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f64, b: f64) -> u64 {
        a.to_bits().abs_diff(b.to_bits())
    }

    #[test]
    fn the_constants_are_what_they_claim() {
        let mut f = 1.0f64;
        for (n, &c) in INV_FACT.iter().enumerate() {
            if n > 0 {
                f *= n as f64; // exact up to 13! < 2^53
            }
            assert_eq!(c, 1.0 / f, "1/{n}!");
        }
        assert_eq!(LOG2E, std::f64::consts::LOG2_E);
        assert!(ulps(LN2_HI + LN2_LO, std::f64::consts::LN_2) == 0);
        assert_eq!(LN2_HI.to_bits() & ((1 << 21) - 1), 0);
    }

    #[test]
    fn within_one_ulp_of_exp_over_the_sampling_range() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut worst = 0;
        let mut exact = 0;
        let n = 200_000;
        for i in 0..n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 11) as f64 / (1u64 << 53) as f64;
            let scale = [1e-9, 1e-3, 1.0, 10.0, 100.0, 707.0][i % 6];
            let v = -u * scale;
            let (a, b) = (det_exp(v), v.exp());
            worst = worst.max(ulps(a, b));
            exact += (a == b) as usize;
        }
        assert!(worst <= 1, "worst {worst} ulp");
        assert!(exact > n * 8 / 10, "only {exact} of {n} exact");
        // Positive arguments too (not used by sampling, but defined).
        for v in [1e-6, 0.5, 1.0, 20.0, 700.0] {
            assert!(ulps(det_exp(v), v.exp()) <= 1, "{v}");
        }
    }

    #[test]
    fn exact_points_and_the_edges() {
        assert_eq!(det_exp(0.0).to_bits(), 1f64.to_bits());
        assert_eq!(det_exp(-0.0).to_bits(), 1f64.to_bits());
        assert_eq!(det_exp(-708.0), 0.0);
        assert_eq!(det_exp(f64::NEG_INFINITY), 0.0);
        assert!(det_exp(-707.9) > 0.0 && det_exp(-707.9).is_normal());
        assert_eq!(det_exp(709.0), f64::INFINITY);
        assert!(det_exp(f64::NAN).is_nan());
        // Monotone across a range boundary of k.
        let h = std::f64::consts::LN_2 / 2.0;
        assert!(det_exp(-h - 1e-12) < det_exp(-h + 1e-12));
    }
}
