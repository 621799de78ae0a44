//! IQ4 formats: 4-bit indices into the fixed non-linear codebook `kvalues_iq4nl`.
//! Layouts as in ggml-common.h (`ggml_half` = little-endian IEEE binary16):
//!
//! ```text
//! kvalues_iq4nl = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
//!
//! block_iq4_nl (18 B)  { ggml_half d; uint8_t qs[16]; }          32 elements
//!     y[j]      = d * kvalues[qs[j] & 0xF]       j in 0..16
//!     y[j + 16] = d * kvalues[qs[j] >>  4]
//! block_iq4_xs (136 B) { ggml_half d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; }
//!     256 elements in 8 sub-blocks of 32; sub-block ib has the signed 6-bit scale
//!         ls = (((scales_l[ib/2] >> 4*(ib%2)) & 0xF) | ((scales_h >> 2*ib) & 3) << 4) - 32
//!     and within it, like iq4_nl with q = qs[16*ib .. 16*ib + 16]:
//!         y[32*ib + j]      = (d * ls) * kvalues[q[j] & 0xF]
//!         y[32*ib + j + 16] = (d * ls) * kvalues[q[j] >>  4]
//! ```
//!
//! Single f32 products of the same operands as gguf-py: bit-identical.

use super::f16_at;

/// The IQ4_NL / IQ4_XS codebook (`kvalues_iq4nl` in ggml-common.h).
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The codebook as f32, so the inner loops are a table load and a multiply.
const KV: [f32; 16] = {
    let mut t = [0.0f32; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = KVALUES_IQ4NL[i] as f32;
        i += 1;
    }
    t
};

pub(crate) fn dequant_iq4_nl(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = d * KV[(qs[j] & 0xF) as usize];
        y[j + 16] = d * KV[(qs[j] >> 4) as usize];
    }
}

pub(crate) fn dequant_iq4_xs(b: &[u8; 136], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    let scales_l = &b[4..8];
    let qs = &b[8..136];
    for ib in 0..8 {
        let low = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF;
        let high = ((scales_h >> (2 * ib)) & 3) as u8;
        let ls = (low | high << 4) as i32 - 32;
        let dl = d * ls as f32;
        let q = &qs[16 * ib..16 * ib + 16];
        let yb = &mut y[32 * ib..32 * ib + 32];
        for j in 0..16 {
            yb[j] = dl * KV[(q[j] & 0xF) as usize];
            yb[j + 16] = dl * KV[(q[j] >> 4) as usize];
        }
    }
}
