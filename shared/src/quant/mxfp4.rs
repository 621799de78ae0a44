//! MXFP4 (OCP microscaling FP4): 32 e2m1 values sharing one power-of-two e8m0 scale.
//! Layout as in ggml-common.h:
//!
//! ```text
//! block_mxfp4 (17 B) { uint8_t e; uint8_t qs[16]; }
//!     y[j]      = d * kvalues_mxfp4[qs[j] & 0xF]       j in 0..16
//!     y[j + 16] = d * kvalues_mxfp4[qs[j] >>  4]
//! ```
//!
//! ggml/gguf-py store the e2m1 codebook *doubled* so it is integral,
//! `kvalues_mxfp4 = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]`
//! (e2m1 is {0, 0.5, 1, 1.5, 2, 3, 4, 6} with a sign bit), and compensate by using *half*
//! the e8m0 scale, `ggml_e8m0_to_fp32_half(e)` = 2^(e - 128) as an f32 bit pattern:
//! `e < 2 ? 0x0020_0000 << e : (e - 1) << 23` (e = 0 and 1 give the subnormals 2^-128 and
//! 2^-127). Every product is a small integer times a power of two, so it is exact unless it
//! overflows (e = 0xFF, the e8m0 NaN encoding, gives 2^127 here, and values up to 12 * 2^127
//! = inf, as gguf-py does too).

/// The doubled e2m1 codebook (`kvalues_mxfp4` in ggml-common.h).
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

const KV: [f32; 16] = {
    let mut t = [0.0f32; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = KVALUES_MXFP4[i] as f32;
        i += 1;
    }
    t
};

/// Half the e8m0 scale `e`, i.e. 2^(e - 128), exactly as `ggml_e8m0_to_fp32_half`.
#[inline(always)]
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        ((e as u32) - 1) << 23
    };
    f32::from_bits(bits)
}

pub(crate) fn dequant_mxfp4(b: &[u8; 17], y: &mut [f32; 32]) {
    let d = e8m0_to_f32_half(b[0]);
    let qs = &b[1..17];
    for j in 0..16 {
        y[j] = d * KV[(qs[j] & 0xF) as usize];
        y[j + 16] = d * KV[(qs[j] >> 4) as usize];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e8m0_half_is_two_to_the_e_minus_128() {
        for e in 0..=254u8 {
            assert_eq!(
                e8m0_to_f32_half(e),
                2f64.powi(e as i32 - 128) as f32,
                "e = {e}"
            );
        }
        assert_eq!(e8m0_to_f32_half(127), 0.5);
    }
}
