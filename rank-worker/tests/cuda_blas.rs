//! Dense prefill products through cuBLAS (rank-worker/src/cuda/blas.rs) against CPU twins:
//! the bf16 dequantization of every type bit for bit, the products against f64 dot products
//! (strided, accumulating, sizes off any tile, weights cut in row slices), F32 weights through
//! SGEMM at f32 accuracy, and which products the dispatcher hands to cuBLAS. Outputs are
//! poisoned with NaN before every launch; NaN never passes. Needs a GPU: run with `--ignored`.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Mutex;

use common::gpu::{NAN, Rng, TYPES, dot, gpu, random_rows, upload_mat};
use minimax_rank::cuda::blas::{set_blas, set_blas_min_tokens, set_blas_slice_elems};
use minimax_rank::cuda::{Arg, GemmPrecision, Gpu, set_gemm_precision};
use minimax_shared::quant::{self, GgmlType};

/// The switches are process-wide: tests run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Columns: a multiple of 256 for the K-quants, else 32 x 37 (off every power-of-two tile).
fn cols_for(ty: GgmlType) -> usize {
    if ty.block_elems() == 256 { 256 * 5 } else { 32 * 37 }
}

/// The cuBLAS path's kernels and products did run (or did not) in `f`'s launches.
fn ran_blas(g: &Gpu, f: impl FnOnce()) -> bool {
    g.profile_begin();
    f();
    let prof = g.profile_end().unwrap();
    prof.iter().any(|(n, _)| n.starts_with("blas_"))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn dequantization_to_bf16_is_exact_for_every_type() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = gpu();
    let mut rng = Rng(0xb1a5_0001);
    for ty in TYPES {
        let (rows, cols) = (37usize, cols_for(ty));
        let w = random_rows(&mut rng, ty, rows, cols);
        let (_wb, m) = upload_mat(&g, ty, &w, rows, cols, 0);
        let want: Vec<u16> = quant::dequantize_to_vec(ty, &w, rows * cols).unwrap().iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
        let out = g.zeros::<u16>(rows * cols + 64).unwrap();
        // Poison (0xffff is a NaN bf16), including 64 elements past the end that must stay so.
        g.fill_u32(g.ptr(&out), (rows * cols + 64) / 2, 0xffff_ffff).unwrap();
        let per_row = if ty.block_elems() == 1 { cols } else { cols / 32 };
        let name = format!("dqb_{}", ty.name().to_ascii_lowercase());
        g.launch(&name, ((rows * per_row).div_ceil(256) as u32, 1, 1), 256, 0, &[Arg::P(m.ptr), Arg::L(m.row_bytes as i64), Arg::I(rows as i32), Arg::I(cols as i32), Arg::P(g.ptr(&out))]).unwrap();
        let got = g.download(&out).unwrap();
        for (i, (&a, &b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(a, b, "{name}: element {i} (row {}, col {}): got {a:#06x}, want {b:#06x}", i / cols, i % cols);
        }
        assert!(got[rows * cols..].iter().all(|&v| v == 0xffff), "{name} wrote past its rows");
    }
    // The input conversion: strided f32 rows to packed bf16 (round to nearest even).
    let (n, cols, xs) = (70usize, 96usize, 100usize);
    let x = rng.vec(n * xs, 3.0);
    let xd = g.upload(&x).unwrap();
    let out = g.zeros::<u16>(n * cols).unwrap();
    g.fill_u32(g.ptr(&out), n * cols / 2, 0xffff_ffff).unwrap();
    g.launch("x_bf16", (cols.div_ceil(1024) as u32, n as u32, 1), 256, 0, &[Arg::P(g.ptr(&xd)), Arg::L(xs as i64), Arg::I(n as i32), Arg::I(cols as i32), Arg::P(g.ptr(&out))]).unwrap();
    let got = g.download(&out).unwrap();
    for t in 0..n {
        for c in 0..cols {
            assert_eq!(got[t * cols + c], half::bf16::from_f32(x[t * xs + c]).to_bits(), "x_bf16 row {t} col {c}");
        }
    }
}

/// One product through `matmul_blas` against the f64 reference, every output checked: `bound`
/// is the allowed |error| as a fraction of Σ|w·x|, `rms_lim` the RMS error relative to the RMS
/// output (a wrong or missing 32-column chunk gives ~16%). Returns (worst, rms).
#[allow(clippy::too_many_arguments)]
fn check(g: &Gpu, rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize, n: usize, (xs, ys): (usize, usize), accumulate: bool, bound: f64, rms_lim: f64, what: &str) -> (f64, f64) {
    let w = random_rows(rng, ty, rows, cols);
    let wf = quant::dequantize_to_vec(ty, &w, rows * cols).unwrap();
    let (_wb, m) = upload_mat(g, ty, &w, rows, cols, 0);
    let x = rng.vec(n * xs, 1.0);
    let xd = g.upload(&x).unwrap();
    // Accumulating: Y starts from random values larger than each output's tolerance (so a
    // dropped `beta` fails per element); else NaN everywhere. Padding columns of Y (ys > rows)
    // start as NaN either way and must stay so.
    let mut y0: Vec<f32> = vec![f32::from_bits(NAN); n * ys];
    if accumulate {
        for t in 0..n {
            for r in 0..rows {
                y0[t * ys + r] = 50.0 + 50.0 * rng.f().abs();
            }
        }
    }
    let yd = g.upload(&y0).unwrap();
    g.matmul_blas(&m, g.ptr(&xd), xs, g.ptr(&yd), ys, n, accumulate).unwrap();
    let y = g.download(&yd).unwrap();
    let (mut worst, mut se, mut ss) = (0f64, 0f64, 0f64);
    for t in 0..n {
        for r in 0..rows {
            let (mut want, abs) = dot(&wf[r * cols..(r + 1) * cols], &x[t * xs..t * xs + cols]);
            if accumulate {
                want += y0[t * ys + r] as f64;
            }
            let got = y[t * ys + r];
            let err = (got as f64 - want).abs();
            let tol = bound * abs + 1e-6;
            assert!(err <= tol, "{what}: token {t} row {r}: got {got}, want {want}, |err| {err:.3e} > {tol:.3e}");
            worst = worst.max(err / abs.max(1e-30));
            se += err * err;
            ss += want * want;
        }
        for r in rows..ys {
            assert!(y[t * ys + r].is_nan(), "{what}: token {t} padding column {r} was written");
        }
    }
    let rms = (se / ss.max(1e-30)).sqrt();
    assert!(rms <= rms_lim, "{what}: rms error {rms:.2e} relative (limit {rms_lim:.0e})");
    (worst, rms)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn products_match_the_cpu_for_every_type() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = gpu();
    assert!(g.blas().is_some(), "cuBLAS must load on a GPU machine (libcublas on LD_LIBRARY_PATH)");
    let mut rng = Rng(0xb1a5_0002);
    set_gemm_precision(GemmPrecision::Int8);
    for ty in TYPES {
        if ty == GgmlType::F16 {
            continue;
        }
        let cols = cols_for(ty);
        for (n, rows, strided, accumulate) in [(77usize, 261usize, false, false), (300, 130, true, true), (33, 64, true, false)] {
            let (xs, ys) = if strided { (cols + 8, rows + 5) } else { (cols, rows) };
            // bf16 W and X (2^-9 relative each) with f32 accumulation; F32 weights stay f32.
            let (bound, rms_lim) = if ty == GgmlType::F32 { (1e-5, 1e-5) } else { (4e-3, 1e-2) };
            let what = format!("{ty:?} {rows}x{cols} n {n} strided {strided} acc {accumulate}");
            let (worst, rms) = check(&g, &mut rng, ty, rows, cols, n, (xs, ys), accumulate, bound, rms_lim, &what);
            eprintln!("{what}: worst {worst:.2e} of Σ|w·x|, rms {rms:.2e}");
        }
    }
    // Weights cut in row slices (lm_head-sized matrices): 5 slices of 56 rows, the last short.
    set_blas_slice_elems(Some(56 * 32 * 37));
    let r = check(&g, &mut rng, GgmlType::Q8_0, 261, 32 * 37, 90, (32 * 37 + 4, 270), true, 4e-3, 1e-2, "Q8_0 in row slices");
    eprintln!("Q8_0 in row slices: worst {:.2e}, rms {:.2e}", r.0, r.1);
    let r = check(&g, &mut rng, GgmlType::IQ4_XS, 300, 256 * 5, 65, (256 * 5, 300), false, 4e-3, 1e-2, "IQ4_XS in row slices");
    eprintln!("IQ4_XS in row slices: worst {:.2e}, rms {:.2e}", r.0, r.1);
    set_blas_slice_elems(None);
    // Rows stored wider than the product uses (a column slice of a BF16 / F32 matrix): the
    // leading dimension is the stored row, not the column count.
    for ty in [GgmlType::BF16, GgmlType::F32] {
        let (rows, cols, stored, n) = (70usize, 256usize, 264usize, 80usize);
        let w = random_rows(&mut rng, ty, rows, stored);
        let wf = quant::dequantize_to_vec(ty, &w, rows * stored).unwrap();
        let (_wb, full) = upload_mat(&g, ty, &w, rows, stored, 0);
        let m = minimax_rank::cuda::DevMat { cols, ..full };
        let x = rng.vec(n * cols, 1.0);
        let xd = g.upload(&x).unwrap();
        let yd = g.upload(&vec![f32::from_bits(NAN); n * rows]).unwrap();
        g.matmul_blas(&m, g.ptr(&xd), cols, g.ptr(&yd), rows, n, false).unwrap();
        let y = g.download(&yd).unwrap();
        let bound = if ty == GgmlType::F32 { 1e-5 } else { 4e-3 };
        for t in 0..n {
            for r in 0..rows {
                let (want, abs) = dot(&wf[r * stored..r * stored + cols], &x[t * cols..(t + 1) * cols]);
                let got = y[t * rows + r] as f64;
                assert!((got - want).abs() <= bound * abs + 1e-6, "{ty:?} rows stored {stored} wide: token {t} row {r}: got {got}, want {want}");
            }
        }
    }
    // Stride shorter than the row: an error, never a launch.
    let w = random_rows(&mut rng, GgmlType::Q8_0, 64, 256);
    let (_wb, m) = upload_mat(&g, GgmlType::Q8_0, &w, 64, 256, 0);
    let xd = g.zeros::<f32>(100 * 256).unwrap();
    let yd = g.zeros::<f32>(100 * 64).unwrap();
    assert!(g.matmul_blas(&m, g.ptr(&xd), 200, g.ptr(&yd), 64, 100, false).is_err(), "input stride below the row length");
    assert!(g.matmul_blas(&m, g.ptr(&xd), 256, g.ptr(&yd), 60, 100, false).is_err(), "output stride below the rows");
    set_gemm_precision(GemmPrecision::Bf16x3);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn products_sharing_one_input_convert_it_once() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = gpu();
    let mut rng = Rng(0xb1a5_0004);
    set_gemm_precision(GemmPrecision::Int8);
    set_blas(Some(true));
    // q, k and v of a small layer: 3 outputs of different widths, strided Y, 150 tokens.
    let (cols, n, xs) = (512usize, 150usize, 520usize);
    let shapes = [(GgmlType::Q8_0, 384usize, 390usize), (GgmlType::Q8_0, 64, 64), (GgmlType::IQ4_XS, 96, 100)];
    let mut mats = Vec::new();
    for &(ty, rows, _) in &shapes {
        let w = random_rows(&mut rng, ty, rows, cols);
        let wf = quant::dequantize_to_vec(ty, &w, rows * cols).unwrap();
        mats.push((upload_mat(&g, ty, &w, rows, cols, 0), wf));
    }
    let x = rng.vec(n * xs, 1.0);
    let xd = g.upload(&x).unwrap();
    let ys: Vec<_> = shapes.iter().map(|&(_, _, ys)| g.upload(&vec![f32::from_bits(NAN); n * ys]).unwrap()).collect();
    let prods: Vec<_> = mats.iter().zip(&ys).zip(&shapes).map(|((((_, m), _), y), &(_, _, s))| (m, g.ptr(y), s)).collect();
    g.profile_begin();
    g.matvec_shared(&prods, g.ptr(&xd), xs, n).unwrap();
    let prof = g.profile_end().unwrap();
    let conversions = prof.iter().filter(|(k, _)| k == "x_bf16").count();
    assert_eq!(conversions, 1, "one conversion of the shared input, got {conversions}");
    assert_eq!(prof.iter().filter(|(k, _)| k == "blas_gemm_bf16").count(), 3);
    for (i, ((((_, _), wf), y), &(ty, rows, ysd))) in mats.iter().zip(&ys).zip(&shapes).enumerate() {
        let got = g.download(y).unwrap();
        let (mut se, mut ss) = (0f64, 0f64);
        for t in 0..n {
            for r in 0..ysd {
                let v = got[t * ysd + r];
                if r >= rows {
                    assert!(v.is_nan(), "product {i}: padding column {r} written");
                    continue;
                }
                let (want, abs) = dot(&wf[r * cols..(r + 1) * cols], &x[t * xs..t * xs + cols]);
                let err = (v as f64 - want).abs();
                assert!(err <= 4e-3 * abs + 1e-6, "product {i} ({ty:?}) token {t} row {r}: got {v}, want {want}");
                se += err * err;
                ss += want * want;
            }
        }
        let rms = (se / ss).sqrt();
        assert!(rms <= 1e-2, "product {i}: rms {rms:.2e}");
        eprintln!("shared input, product {i} ({ty:?} {rows}x{cols}): rms {rms:.2e}");
    }
    // With cuBLAS off the same call runs each product on the built-in GEMMs (no conversion).
    set_blas(Some(false));
    g.profile_begin();
    g.matvec_shared(&prods, g.ptr(&xd), xs, n).unwrap();
    let prof = g.profile_end().unwrap();
    assert!(!prof.iter().any(|(k, _)| k == "x_bf16" || k.starts_with("blas_")), "MINIMAX_BLAS=0 ran the cuBLAS path");
    set_blas(None);
    set_gemm_precision(GemmPrecision::Bf16x3);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn dispatcher_hands_dense_products_of_many_tokens_to_cublas() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = gpu();
    let mut rng = Rng(0xb1a5_0003);
    let (rows, cols) = (200usize, 512usize);
    let q8 = random_rows(&mut rng, GgmlType::Q8_0, rows, cols);
    let (_b1, mq) = upload_mat(&g, GgmlType::Q8_0, &q8, rows, cols, 0);
    let f32w = random_rows(&mut rng, GgmlType::F32, rows, cols);
    let (_b2, mf) = upload_mat(&g, GgmlType::F32, &f32w, rows, cols, 0);
    let xd = g.upload(&rng.vec(256 * cols, 1.0)).unwrap();
    let yd = g.zeros::<f32>(256 * rows).unwrap();
    let run = |m, n| ran_blas(&g, || g.matvec(m, g.ptr(&xd), cols, g.ptr(&yd), rows, n, false).unwrap());
    set_blas(Some(true));
    set_blas_min_tokens(Some(64));
    set_gemm_precision(GemmPrecision::Int8);
    assert!(run(&mq, 64), "int8 precision, Q8_0, 64 tokens: cuBLAS");
    // Misaligned Q8_0 rows (2-byte loads) never take it.
    assert!(!g.blas_takes(&minimax_rank::cuda::DevMat { ptr: mq.ptr + 1, ..mq }, 100), "odd Q8_0 address");
    assert!(!run(&mq, 63), "below the token threshold: the built-in GEMM");
    assert!(!run(&mq, 8), "decode-sized: the matvec kernels");
    assert!(run(&mf, 100), "F32 weights: SGEMM");
    // Other quantized types: their 3-pass kernels under int8, cuBLAS under one-pass bf16.
    let q4k = random_rows(&mut rng, GgmlType::Q4_K, rows, cols);
    let (_b5, mk) = upload_mat(&g, GgmlType::Q4_K, &q4k, rows, cols, 0);
    assert!(!run(&mk, 100), "int8 precision keeps Q4_K on the built-in kernels");
    set_gemm_precision(GemmPrecision::Bf16);
    assert!(run(&mk, 100), "one-pass bf16 precision: Q4_K through cuBLAS");
    assert!(g.blas_takes(&mq, 65535) && !g.blas_takes(&mq, 65536), "one launch's tokens at most");
    set_gemm_precision(GemmPrecision::Bf16x3);
    assert!(!run(&mq, 100), "bf16x3 keeps quantized weights on the 3-pass kernels");
    assert!(run(&mf, 100), "bf16x3: F32 weights still take SGEMM (exact f32)");
    set_blas(Some(false));
    set_gemm_precision(GemmPrecision::Int8);
    assert!(!run(&mq, 100) && !run(&mf, 100), "MINIMAX_BLAS=0: the built-in GEMMs");
    // Expert tensors never take it.
    let (_b3, me) = upload_mat(&g, GgmlType::Q8_0, &random_rows(&mut rng, GgmlType::Q8_0, 4 * rows, cols), rows, cols, 4);
    set_blas(Some(true));
    assert!(!g.blas_takes(&me, 100), "expert tensors keep the grouped kernels");
    let (_b4, mh) = upload_mat(&g, GgmlType::F16, &random_rows(&mut rng, GgmlType::F16, rows, cols), rows, cols, 0);
    assert!(!g.blas_takes(&mh, 100), "F16 keeps the built-in kernels");
    set_blas(None);
    set_blas_min_tokens(None);
    set_gemm_precision(GemmPrecision::Bf16x3);
}
