//! Unquantized element types: F32, F16, BF16. ggml counts them as blocks of one element.
//!
//! ```text
//! F32   4 bytes  IEEE binary32, little-endian
//! F16   2 bytes  IEEE binary16 (ggml_half), little-endian; value = exact widening to f32
//! BF16  2 bytes  the high 16 bits of a binary32 (ggml_bf16_t), little-endian;
//!                value = f32::from_bits((bits as u32) << 16)   (gguf-py: int16 -> int32 << 16)
//! ```
//!
//! All three conversions are exact, so there is no rounding to disagree about.

use super::{LANES, f16_to_f32, mac, reduce};

/// Elements converted per stack-buffer chunk in the F16/BF16 dot products.
const CHUNK: usize = 64;

#[inline(always)]
fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

pub(crate) fn dequant_f32(bytes: &[u8], out: &mut [f32]) {
    let (bs, _) = bytes.as_chunks::<4>();
    for (b, y) in bs.iter().zip(out.iter_mut()) {
        *y = f32::from_le_bytes(*b);
    }
}

pub(crate) fn dequant_f16(bytes: &[u8], out: &mut [f32]) {
    let (bs, _) = bytes.as_chunks::<2>();
    for (b, y) in bs.iter().zip(out.iter_mut()) {
        *y = f16_to_f32(u16::from_le_bytes(*b));
    }
}

pub(crate) fn dequant_bf16(bytes: &[u8], out: &mut [f32]) {
    let (bs, _) = bytes.as_chunks::<2>();
    for (b, y) in bs.iter().zip(out.iter_mut()) {
        *y = bf16_to_f32(u16::from_le_bytes(*b));
    }
}

/// Shared body of the float dots: convert `CHUNK` elements at a time into a stack buffer and
/// multiply-accumulate; the tail (fewer than `CHUNK` elements) goes through the same buffer.
#[inline(always)]
fn dot_conv<const EB: usize>(bytes: &[u8], x: &[f32], conv: impl Fn([u8; EB]) -> f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut buf = [0.0f32; CHUNK];
    let (bs, _) = bytes.as_chunks::<EB>();
    let mut bchunks = bs.chunks_exact(CHUNK);
    let mut xchunks = x.chunks_exact(CHUNK);
    for (bc, xc) in (&mut bchunks).zip(&mut xchunks) {
        for (y, b) in buf.iter_mut().zip(bc) {
            *y = conv(*b);
        }
        mac(&mut acc, &buf, xc);
    }
    let (brem, xrem) = (bchunks.remainder(), xchunks.remainder());
    let n = brem.len().min(xrem.len());
    if n > 0 {
        buf.fill(0.0);
        for (y, b) in buf.iter_mut().zip(brem) {
            *y = conv(*b);
        }
        let mut xt = [0.0f32; CHUNK];
        xt[..n].copy_from_slice(&xrem[..n]);
        mac(&mut acc, &buf, &xt);
    }
    reduce(acc)
}

pub(crate) fn dot_f32(bytes: &[u8], x: &[f32]) -> f32 {
    dot_conv::<4>(bytes, x, f32::from_le_bytes)
}

pub(crate) fn dot_f16(bytes: &[u8], x: &[f32]) -> f32 {
    dot_conv::<2>(bytes, x, |b| f16_to_f32(u16::from_le_bytes(b)))
}

pub(crate) fn dot_bf16(bytes: &[u8], x: &[f32]) -> f32 {
    dot_conv::<2>(bytes, x, |b| bf16_to_f32(u16::from_le_bytes(b)))
}
