//! The CPU dequantizers against gguf-py's (gguf 0.19.0), on the vectors in
//! `tests/data/quant/` made by `tools/quant_vectors/gen_vectors.py`.
//!
//! Every supported type is compared bit for bit (`f32::to_bits`, so ±0 must match too): each
//! Rust dequantizer performs the same f32 operations on the same operands in the same order as
//! gguf-py's numpy code (one f32 product, plus one separate f32 add/subtract for the types with
//! a min; neither side fuses into an FMA), so no ulp slack is needed anywhere. If a future type
//! needs one (a different association of a three-factor product, say), give it an explicit
//! per-type allowance in `ULP_SLACK` with the reason.

use std::path::PathBuf;

use minimax_shared::quant::{self, GgmlType, QuantError};
use proptest::prelude::*;

const TYPES: [GgmlType; 16] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
];

/// Allowed distance in ulps per type. Empty: everything is bit-exact.
const ULP_SLACK: &[(GgmlType, u32)] = &[];

/// Rows per vector file (the generator writes 4 rows of whole blocks).
const ROWS: usize = 4;

struct Vectors {
    bytes: Vec<u8>,
    expected: Vec<f32>,
}

fn load(ty: GgmlType) -> Vectors {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/quant");
    let bytes = std::fs::read(dir.join(format!("{}.bin", ty.name())))
        .unwrap_or_else(|e| panic!("{ty}: {e} (run tools/quant_vectors/gen_vectors.py)"));
    let raw = std::fs::read(dir.join(format!("{}.f32", ty.name()))).unwrap();
    assert_eq!(raw.len() % 4, 0);
    let expected: Vec<f32> = raw
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(
        ty.bytes_for(expected.len() as u64),
        Some(bytes.len() as u64),
        "{ty} vector sizes"
    );
    assert_eq!(expected.len() % ROWS, 0);
    Vectors { bytes, expected }
}

/// Deterministic uniform(-1, 1) numbers (xorshift64*), no dependency needed.
fn rand_vec(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let r = s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40; // 24 bits
            (r as f32 / (1u32 << 23) as f32) - 1.0
        })
        .collect()
}

fn ulps(a: f32, b: f32) -> u32 {
    // Distance on the monotone integer line of f32 bit patterns (treats +0 and -0 as 1 apart).
    let key = |f: f32| {
        let i = f.to_bits() as i32;
        if i < 0 { i32::MIN - i } else { i }
    };
    key(a).abs_diff(key(b))
}

#[test]
fn dequantize_matches_gguf_py_bit_exactly() {
    for ty in TYPES {
        let v = load(ty);
        let slack = ULP_SLACK
            .iter()
            .find(|(t, _)| *t == ty)
            .map_or(0, |(_, s)| *s);
        let mut out = vec![f32::NAN; v.expected.len()];
        quant::dequantize(ty, &v.bytes, &mut out).unwrap();
        let mut mismatches = 0;
        for (i, (&got, &want)) in out.iter().zip(&v.expected).enumerate() {
            let ok = if slack == 0 {
                got.to_bits() == want.to_bits()
            } else {
                ulps(got, want) <= slack
            };
            if !ok {
                if mismatches < 5 {
                    eprintln!(
                        "{ty}[{i}] (block {}): got {got:e} ({:#010x}), want {want:e} ({:#010x})",
                        i / ty.block_elems(),
                        got.to_bits(),
                        want.to_bits()
                    );
                }
                mismatches += 1;
            }
        }
        assert_eq!(
            mismatches,
            0,
            "{ty}: {mismatches} of {} elements differ",
            out.len()
        );

        // Row by row gives the same as the whole buffer.
        let elems = v.expected.len() / ROWS;
        let rb = quant::row_bytes(ty, elems).unwrap();
        for r in 0..ROWS {
            let row = quant::dequantize_to_vec(ty, &v.bytes[r * rb..(r + 1) * rb], elems).unwrap();
            assert_eq!(
                row.iter().map(|f| f.to_bits()).collect::<Vec<_>>(),
                out[r * elems..(r + 1) * elems]
                    .iter()
                    .map(|f| f.to_bits())
                    .collect::<Vec<_>>(),
                "{ty} row {r}"
            );
        }
    }
}

#[test]
fn dot_and_matvec_match_dequantized_products() {
    for ty in TYPES {
        let v = load(ty);
        let cols = v.expected.len() / ROWS;
        let rb = quant::row_bytes(ty, cols).unwrap();
        for seed in 1..=3u64 {
            let mut x = rand_vec(seed * 1000 + ty.id() as u64, cols);
            // The edge vectors hold values near f32::MAX (F32 edges, MXFP4 with e = 252) whose
            // products would overflow f32 in any summation order: leave those out of the dot.
            for r in 0..ROWS {
                for (c, xc) in x.iter_mut().enumerate() {
                    if v.expected[r * cols + c].abs() > 1e30 {
                        *xc = 0.0;
                    }
                }
            }
            let mut y = vec![0.0; ROWS];
            quant::matvec(ty, &v.bytes, ROWS, cols, &x, &mut y).unwrap();
            for (r, yr) in y.iter().enumerate() {
                let deq = &v.expected[r * cols..(r + 1) * cols];
                let want: f64 = deq.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
                let mag: f64 = deq
                    .iter()
                    .zip(&x)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum();
                let got = quant::dot(ty, &v.bytes[r * rb..(r + 1) * rb], &x).unwrap();
                // f32 accumulation of <= 384 terms per lane: error well under 1e-5 * sum|terms|.
                let tol = 1e-5 * mag + 1e-35;
                assert!(
                    (got as f64 - want).abs() <= tol,
                    "{ty} row {r} seed {seed}: dot {got:e}, want {want:e} (tol {tol:e})"
                );
                assert_eq!(yr.to_bits(), got.to_bits(), "{ty} row {r}: matvec != dot");
            }
        }
    }
}

#[test]
fn wrong_lengths_are_errors() {
    for ty in TYPES {
        let be = ty.block_elems();
        let bb = ty.block_bytes();
        let bytes = vec![0u8; 2 * bb];
        let mut out = vec![0.0; 2 * be];
        quant::dequantize(ty, &bytes, &mut out).unwrap();
        assert_eq!(quant::dot(ty, &bytes, &out).unwrap(), 0.0);

        let short = &bytes[..2 * bb - 1];
        let e = quant::dequantize(ty, short, &mut out).unwrap_err();
        assert_eq!(
            e,
            QuantError::BadLength {
                ty,
                bytes: 2 * bb - 1,
                elems: 2 * be
            }
        );
        assert!(matches!(
            quant::dot(ty, short, &out),
            Err(QuantError::BadLength { .. })
        ));
        let mut long = bytes.clone();
        long.push(0);
        assert!(matches!(
            quant::dequantize(ty, &long, &mut out),
            Err(QuantError::BadLength { .. })
        ));
        if be > 1 {
            // Not a whole number of blocks.
            let e = quant::dequantize(ty, &bytes, &mut out[..2 * be - 1]).unwrap_err();
            assert!(matches!(e, QuantError::BadLength { .. }), "{ty}: {e}");
            assert!(e.to_string().contains(ty.name()), "{e}");
            assert!(quant::row_bytes(ty, be + 1).is_err());
        }
        assert_eq!(quant::row_bytes(ty, 4 * be).unwrap(), 4 * bb);
    }
}

#[test]
fn unsupported_types_error() {
    for ty in GgmlType::ALL.into_iter().filter(|t| !TYPES.contains(t)) {
        assert!(!ty.is_supported(), "{ty}");
        let bytes = vec![0u8; ty.block_bytes()];
        let mut out = vec![0.0; ty.block_elems()];
        let e = quant::dequantize(ty, &bytes, &mut out).unwrap_err();
        assert_eq!(e, QuantError::Unsupported(ty));
        assert_eq!(e.to_string(), format!("not yet supported: {ty}"));
        assert_eq!(
            quant::dot(ty, &bytes, &out).unwrap_err(),
            QuantError::Unsupported(ty)
        );
        assert!(matches!(
            quant::row_bytes(ty, ty.block_elems()),
            Err(QuantError::Unsupported(_))
        ));
    }
    for ty in TYPES {
        assert!(ty.is_supported(), "{ty}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any type, any byte length, any element count: an answer, never a panic, and Ok exactly
    /// when the type is supported and the lengths agree.
    #[test]
    fn never_panics_on_any_length(
        ti in 0..GgmlType::ALL.len(),
        bytes in proptest::collection::vec(any::<u8>(), 0..700),
        elems in 0usize..600,
        whole in any::<bool>(),
    ) {
        let ty = GgmlType::ALL[ti];
        // Half the time, make the lengths consistent so the Ok path gets random bytes too.
        let (bytes, elems) = if whole && ty.is_supported() {
            let nb = elems / ty.block_elems();
            let n = nb * ty.block_bytes();
            let mut b = bytes;
            b.resize(n, 0x5A);
            (b, nb * ty.block_elems())
        } else {
            (bytes, elems)
        };
        let fits = ty.bytes_for(elems as u64) == Some(bytes.len() as u64);
        let mut out = vec![0.0f32; elems];
        let r = quant::dequantize(ty, &bytes, &mut out);
        prop_assert_eq!(r.is_ok(), ty.is_supported() && fits);
        let x = vec![1.0f32; elems];
        let d = quant::dot(ty, &bytes, &x);
        prop_assert_eq!(d.is_ok(), ty.is_supported() && fits);
        let mut y = [0.0f32; 2];
        let _ = quant::matvec(ty, &bytes, 2, elems / 2, &x[..elems / 2], &mut y);
    }
}
