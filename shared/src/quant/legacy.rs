//! The original ggml block formats: 32 elements per block, one fp16 scale (and a min for the
//! `_1` variants). Layouts as in ggml-common.h (`ggml_half` = little-endian IEEE binary16):
//!
//! ```text
//! block_q4_0 (18 B)  { ggml_half d; uint8_t qs[16]; }
//!     y[j]      = d * ((qs[j] & 0xF) - 8)          j in 0..16
//!     y[j + 16] = d * ((qs[j] >>  4) - 8)
//! block_q4_1 (20 B)  { ggml_half d; ggml_half m; uint8_t qs[16]; }
//!     y[j]      = d * (qs[j] & 0xF) + m            (two roundings: mul then add, no FMA)
//!     y[j + 16] = d * (qs[j] >>  4) + m
//! block_q5_0 (22 B)  { ggml_half d; uint8_t qh[4]; uint8_t qs[16]; }
//!     h = u32::from_le_bytes(qh); bit i of h is the 5th bit of element i
//!     y[j]      = d * (((qs[j] & 0xF) | ((h >> j)        & 1) << 4) - 16)
//!     y[j + 16] = d * (((qs[j] >>  4) | ((h >> (j + 16)) & 1) << 4) - 16)
//! block_q5_1 (24 B)  { ggml_half d; ggml_half m; uint8_t qh[4]; uint8_t qs[16]; }
//!     as q5_0 without the -16, then * d + m
//! block_q8_0 (34 B)  { ggml_half d; int8_t qs[32]; }
//!     y[j] = d * qs[j]
//! ```
//!
//! gguf-py computes each element as a single f32 product (plus one f32 add for the `_1`
//! types) of exactly these operands, so the results below are bit-identical to it.

use super::f16_at;

pub(crate) fn dequant_q4_0(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = d * ((qs[j] & 0xF) as i32 - 8) as f32;
        y[j + 16] = d * ((qs[j] >> 4) as i32 - 8) as f32;
    }
}

pub(crate) fn dequant_q4_1(b: &[u8; 20], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = d * (qs[j] & 0xF) as f32 + m;
        y[j + 16] = d * (qs[j] >> 4) as f32 + m;
    }
}

pub(crate) fn dequant_q5_0(b: &[u8; 22], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let h = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let lo = (qs[j] & 0xF) as u32 | ((h >> j) & 1) << 4;
        let hi = (qs[j] >> 4) as u32 | ((h >> (j + 16)) & 1) << 4;
        y[j] = d * (lo as i32 - 16) as f32;
        y[j + 16] = d * (hi as i32 - 16) as f32;
    }
}

pub(crate) fn dequant_q5_1(b: &[u8; 24], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let h = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let lo = (qs[j] & 0xF) as u32 | ((h >> j) & 1) << 4;
        let hi = (qs[j] >> 4) as u32 | ((h >> (j + 16)) & 1) << 4;
        y[j] = d * lo as f32 + m;
        y[j + 16] = d * hi as f32 + m;
    }
}

pub(crate) fn dequant_q8_0(b: &[u8; 34], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = d * (b[2 + j] as i8) as f32;
    }
}
