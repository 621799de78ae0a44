//! K-quants: 256-element super-blocks (QK_K = 256) split into sub-blocks with their own
//! small integer scales, themselves scaled by fp16 super-block factors. Layouts as in
//! ggml-common.h (`ggml_half` = little-endian IEEE binary16):
//!
//! ```text
//! block_q2_K (84 B)  { uint8_t scales[16]; uint8_t qs[64]; ggml_half d; ggml_half dmin; }
//!     16 sub-blocks of 16; scales[s] = min(4 bits, high) | scale(4 bits, low)
//!     element e = 128*g + 32*k + l  (g in 0..2, k in 0..4, l in 0..32):
//!         q = (qs[32*g + l] >> 2k) & 3,  s = e / 16
//!         y[e] = (d * (scales[s] & 0xF)) * q - (dmin * (scales[s] >> 4))
//! block_q3_K (110 B) { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; ggml_half d; }
//!     16 sub-blocks of 16 with signed 6-bit scales packed as
//!         sc[i] = (i < 8 ? scales[i] & 0xF : scales[i-8] >> 4)
//!               | ((scales[8 + i%4] >> 2*(i/4)) & 3) << 4,   then minus 32
//!     element e = 128*g + 32*k + l:
//!         low  = (qs[32*g + l] >> 2k) & 3
//!         high = (hmask[l] >> (4g + k)) & 1           (set bit = no offset)
//!         y[e] = (d * sc[e/16]) * (low - (high ? 0 : 4))
//! block_q4_K (144 B) { ggml_half d; ggml_half dmin; uint8_t scales[12]; uint8_t qs[128]; }
//!     8 sub-blocks of 32 with 6-bit scale and min (get_scale_min_k4):
//!         j < 4: sc = scales[j] & 63,                  m = scales[j+4] & 63
//!         j >= 4: sc = (scales[j+4] & 0xF) | ((scales[j-4] >> 6) << 4)
//!                 m  = (scales[j+4] >>  4) | ((scales[j]   >> 6) << 4)
//!     element e = 64*g + 32*h + l  (g in 0..4, h in 0..2): q = (qs[32*g + l] >> 4h) & 0xF
//!         y[e] = (d * sc[e/32]) * q - (dmin * m[e/32])
//! block_q5_K (176 B) { ggml_half d; ggml_half dmin; uint8_t scales[12]; uint8_t qh[32];
//!                      uint8_t qs[128]; }
//!     as q4_K, with q |= ((qh[l] >> (e/32)) & 1) << 4   (l = e % 32)
//! block_q6_K (210 B) { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; ggml_half d; }
//!     element e = 128*g + 32*k + l  (g in 0..2, k in 0..4, l in 0..32):
//!         low  = (ql[64*g + 32*(k%2) + l] >> 4*(k/2)) & 0xF
//!         high = (qh[32*g + l] >> 2k) & 3
//!         y[e] = (d * scales[e/16]) * ((low | high << 4) - 32)
//! ```
//!
//! The products are grouped exactly as in gguf-py (sub-block factor first, f32, then times the
//! quant; the min term is its own product, subtracted last), so results are bit-identical.

use super::f16_at;

pub(crate) fn dequant_q2_k(b: &[u8; 84], y: &mut [f32; 256]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    let mut dl = [0.0f32; 16];
    let mut ml = [0.0f32; 16];
    for s in 0..16 {
        dl[s] = d * (scales[s] & 0xF) as f32;
        ml[s] = dmin * (scales[s] >> 4) as f32;
    }
    for g in 0..2 {
        let q = &qs[32 * g..32 * g + 32];
        for k in 0..4 {
            let base = 128 * g + 32 * k;
            let (s0, s1) = (base / 16, base / 16 + 1);
            let (lo, hi) = y[base..base + 32].split_at_mut(16);
            for l in 0..16 {
                lo[l] = dl[s0] * ((q[l] >> (2 * k)) & 3) as f32 - ml[s0];
                hi[l] = dl[s1] * ((q[l + 16] >> (2 * k)) & 3) as f32 - ml[s1];
            }
        }
    }
}

pub(crate) fn dequant_q3_k(b: &[u8; 110], y: &mut [f32; 256]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let sc = &b[96..108];
    let d = f16_at(b, 108);
    let mut dl = [0.0f32; 16];
    for (i, dli) in dl.iter_mut().enumerate() {
        let low = if i < 8 { sc[i] & 0xF } else { sc[i - 8] >> 4 };
        let high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        let s = (low | high << 4) as i32 - 32;
        *dli = d * s as f32;
    }
    for g in 0..2 {
        for k in 0..4 {
            let base = 128 * g + 32 * k;
            let bit = 4 * g + k;
            let q = &qs[32 * g..32 * g + 32];
            let (d0, d1) = (dl[base / 16], dl[base / 16 + 1]);
            let (lo, hi) = y[base..base + 32].split_at_mut(16);
            for l in 0..16 {
                // The high bit is 1 for "no offset": q = low - 4 * (1 - high).
                let q0 = ((q[l] >> (2 * k)) & 3) as i32 - (((!hmask[l] >> bit) & 1) << 2) as i32;
                let q1 = ((q[l + 16] >> (2 * k)) & 3) as i32
                    - (((!hmask[l + 16] >> bit) & 1) << 2) as i32;
                lo[l] = d0 * q0 as f32;
                hi[l] = d1 * q1 as f32;
            }
        }
    }
}

/// Unpacks the eight 6-bit (scale, min) pairs of Q4_K/Q5_K (`get_scale_min_k4`).
#[inline(always)]
fn scale_min_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 2) & 0x30);
        m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
    (sc, m)
}

pub(crate) fn dequant_q4_k(b: &[u8; 144], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let (sc, m) = scale_min_k4(&b[4..16]);
    let qs = &b[16..144];
    for g in 0..4 {
        let (d1, m1) = (d * sc[2 * g] as f32, dmin * m[2 * g] as f32);
        let (d2, m2) = (d * sc[2 * g + 1] as f32, dmin * m[2 * g + 1] as f32);
        let q = &qs[32 * g..32 * g + 32];
        let (lo, hi) = y[64 * g..64 * g + 64].split_at_mut(32);
        for l in 0..32 {
            lo[l] = d1 * (q[l] & 0xF) as f32 - m1;
            hi[l] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

pub(crate) fn dequant_q5_k(b: &[u8; 176], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let (sc, m) = scale_min_k4(&b[4..16]);
    let qh = &b[16..48];
    let qs = &b[48..176];
    for g in 0..4 {
        let (d1, m1) = (d * sc[2 * g] as f32, dmin * m[2 * g] as f32);
        let (d2, m2) = (d * sc[2 * g + 1] as f32, dmin * m[2 * g + 1] as f32);
        let q = &qs[32 * g..32 * g + 32];
        let (lo, hi) = y[64 * g..64 * g + 64].split_at_mut(32);
        for l in 0..32 {
            let h1 = ((qh[l] >> (2 * g)) & 1) << 4;
            let h2 = ((qh[l] >> (2 * g + 1)) & 1) << 4;
            lo[l] = d1 * ((q[l] & 0xF) | h1) as f32 - m1;
            hi[l] = d2 * ((q[l] >> 4) | h2) as f32 - m2;
        }
    }
}

pub(crate) fn dequant_q6_k(b: &[u8; 210], y: &mut [f32; 256]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    let scales = &b[192..208];
    let d = f16_at(b, 208);
    let mut dl = [0.0f32; 16];
    for (dli, &s) in dl.iter_mut().zip(scales) {
        *dli = d * (s as i8) as f32;
    }
    for g in 0..2 {
        for k in 0..4 {
            let base = 128 * g + 32 * k;
            let lrow = &ql[64 * g + 32 * (k % 2)..64 * g + 32 * (k % 2) + 32];
            let hrow = &qh[32 * g..32 * g + 32];
            let lshift = 4 * (k / 2);
            for (h, yh) in y[base..base + 32].chunks_exact_mut(16).enumerate() {
                let dh = dl[base / 16 + h];
                for (l, yl) in yh.iter_mut().enumerate() {
                    let l = 16 * h + l;
                    let low = (lrow[l] >> lshift) & 0xF;
                    let high = (hrow[l] >> (2 * k)) & 3;
                    *yl = dh * ((low | high << 4) as i32 - 32) as f32;
                }
            }
        }
    }
}
